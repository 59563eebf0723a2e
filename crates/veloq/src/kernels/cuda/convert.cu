// Copies between buffers of f32, f16 and bf16 elements, converting on the way (rounding to
// nearest even): up to four parts in one launch, so that a step's queries, keys and values
// handed over by another framework arrive in one launch instead of one each.
//
// Element types: 0 f32, 1 f16, 2 bf16.

struct ConvertPart {
    unsigned long long src, dst;
    long long n;
    int from, to;
};

struct ConvertParts {
    ConvertPart p[4];
    int count;
};

__device__ __forceinline__ float load_elem(unsigned long long base, int type, long long i) {
    if (type == 0) return reinterpret_cast<const float*>(base)[i];
    const unsigned short u = reinterpret_cast<const unsigned short*>(base)[i];
    return type == 1 ? h2f(u) : __uint_as_float((unsigned int)u << 16);
}

__device__ __forceinline__ void store_elem(unsigned long long base, int type, long long i, float x) {
    if (type == 0) {
        reinterpret_cast<float*>(base)[i] = x;
        return;
    }
    unsigned short u;
    if (type == 1) {
        u = f2h(x);
    } else {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(u) : "f"(x));
    }
    reinterpret_cast<unsigned short*>(base)[i] = u;
}

extern "C" __global__ void vq_convert(ConvertParts parts) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int j = 0; j < parts.count; ++j) {
        const ConvertPart q = parts.p[j];
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < q.n; i += stride) {
            store_elem(q.dst, q.to, i, load_elem(q.src, q.from, i));
        }
    }
}
