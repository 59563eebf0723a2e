// Row-wise work of a layer's many-row steps (prompt chunks) around f16 weight products, so the
// products take and give f16 without a cast launch on each side: the norm writes f16, the gated
// activation reads the gate and up products as f16 and writes the down product's f16 input, and
// a product's f16 output is added into the f32 residual stream in place. The arithmetic is the
// f32 path's (candle's rmsnorm, silu and tanh-GELU formulas), rounded to f16 where the f32 path
// casts.

// out[r] = f16(x[r] · rsqrt(mean(x[r]²) + eps) · w): one block per row.
extern "C" __global__ void __launch_bounds__(256) rows_norm_f16(const float* __restrict__ x, const float* __restrict__ w,
                                                               unsigned short* __restrict__ out, int k, float eps) {
    __shared__ float partial[32];
    const float* xr = x + (size_t)blockIdx.x * k;
    float s = 0.f;
    for (int c = threadIdx.x; c < k; c += blockDim.x) s = fmaf(xr[c], xr[c], s);
    s = warp_sum(s);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    s = lane < warps ? partial[lane] : 0.f;
    s = warp_sum(s);
    const float scale = rsqrtf(s / k + eps);
    unsigned short* o = out + (size_t)blockIdx.x * k;
    for (int c = threadIdx.x; c < k; c += blockDim.x) o[c] = f2h(scale * xr[c] * w[c]);
}

// out = f16(act(gate) · up) over n elements (act 0: silu, 1: GELU, tanh form), 4 a thread.
extern "C" __global__ void rows_gated_f16(const unsigned short* __restrict__ gate, const unsigned short* __restrict__ up,
                                          unsigned short* __restrict__ out, long long n, int act) {
    const long long stride = (long long)gridDim.x * blockDim.x * 4;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (i + j >= n) break;
            const float g = h2f(gate[i + j]), u = h2f(up[i + j]);
            float a;
            if (act == 0) {
                a = g / (1.f + expf(-g));
            } else {
                const float inner = g + 0.044715f * (g * g * g);
                a = 0.5f * g * (1.f + tanhf(0.7978845608028654f * inner));
            }
            out[i + j] = f2h(a * u);
        }
    }
}

// x += f32(y) over n elements, in place.
extern "C" __global__ void rows_add_f16(float* __restrict__ x, const unsigned short* __restrict__ y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] += h2f(y[i]);
}
