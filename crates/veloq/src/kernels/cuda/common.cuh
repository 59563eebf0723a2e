// Shared device helpers for veloq's kernels. Compiled by NVRTC with no system headers: half
// conversion goes through PTX, and every size is a compile-time #define prepended by the host.

#define FULL_MASK 0xffffffffu
#define NEG_MAX (-3.402823466e38f)

// Programmatic dependent launch (launch.rs): a kernel signals on entry that the next one in the
// stream may be scheduled, and waits for its predecessors (their completion and their writes)
// before touching memory they may write or read. Both are no-ops for a kernel launched plainly.
__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asynchronous copies into shared memory (cp.async): a shared address, a 16-byte copy that
// writes zeros when `ok` is false (reading nothing), and waits for all but the N newest groups.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Packed f16 pairs in 32-bit words (PTX, no cuda_fp16.h): {lo, hi} from floats, d = a·b + c lane-wise,
// and back to floats.
__device__ __forceinline__ unsigned int pack_h2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned int hfma2(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float2 unpack_h2(unsigned int r) {
    unsigned short lo, hi;
    asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(r));
    return make_float2(h2f(lo), h2f(hi));
}

// C += A·B on tensor cores, one m16n8k16 tile (f16 in, f32 accumulate). Fragments (g = lane/4,
// t = lane%4): A a0 (row g, k 2t..2t+1), a1 (row g+8), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..);
// B b0 (k 2t..2t+1, column g), b1 (k 2t+8..); C c0, c1 (row g, columns 2t, 2t+1), c2, c3 (row g+8).
__device__ __forceinline__ void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Normalised Walsh–Hadamard transform of one D-vector held by a warp: lane l owns elements
// e = i*32 + l, i < D/32. Stages on lane bits use shuffles, stages on i stay in registers; the
// stages commute, so the result is the Sylvester-ordered H·x/√D of the CPU path.
template <int DD>
__device__ __forceinline__ void warp_fwht(float (&v)[DD / 32], int lane) {
#pragma unroll
    for (int h = 1; h < 32 && h < DD; h <<= 1) {
#pragma unroll
        for (int i = 0; i < DD / 32; i++) {
            float o = __shfl_xor_sync(FULL_MASK, v[i], h);
            v[i] = (lane & h) ? (o - v[i]) : (v[i] + o);
        }
    }
#pragma unroll
    for (int hi = 1; hi < DD / 32; hi <<= 1) {
#pragma unroll
        for (int i = 0; i < DD / 32; i++) {
            if ((i & hi) == 0) {
                float a = v[i], b = v[i | hi];
                v[i] = a + b;
                v[i | hi] = a - b;
            }
        }
    }
    const float norm = rsqrtf((float)DD);
#pragma unroll
    for (int i = 0; i < DD / 32; i++) v[i] *= norm;
}
