// y[b][n] = Σ_k x[b][k]·W[n][k] for a few rows of activations (decode: one per sequence):
// W f16 row-major [N][K] (a model's weight matrix), x f32 [B][K], y f32 [B][N]. Bound by reading
// W once: each warp owns R output rows and streams them in 16-byte loads (8 weights per lane),
// each x chunk loaded once per lane and used for all R rows (x stays in L1/L2: it is small and
// every warp reads it). f32 accumulation, warp-shuffle reduction.
//
// Defines: B (activation rows, 1..8), R (output rows per warp), U (16-byte loads per row a lane
// issues before using them: bytes in flight), THREADS.

#define WARPS (THREADS / 32)

extern "C" __global__ void f16_gemv(const unsigned short* __restrict__ w, const float* __restrict__ x,
                                     float* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * WARPS + warp) * R;
    if (n0 >= N) return;
    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = 0.f;
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int n = n0 + r < N ? n0 + r : N - 1;  // tail rows re-read the last row, never written
        wr[r] = reinterpret_cast<const uint4*>(w + (size_t)n * K);
    }
    const int chunks = K / 8;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
#pragma unroll
            for (int r = 0; r < R; r++) wv[u][r] = c < chunks ? __ldg(wr[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
#pragma unroll
            for (int b = 0; b < B; b++) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)b * K + c * 8);
                const float4 x0 = xp[0], x1 = xp[1];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const float2 p0 = unpack_h2(wv[u][r].x), p1 = unpack_h2(wv[u][r].y);
                    const float2 p2 = unpack_h2(wv[u][r].z), p3 = unpack_h2(wv[u][r].w);
                    float a = acc[r][b];
                    a = fmaf(p0.x, x0.x, a); a = fmaf(p0.y, x0.y, a);
                    a = fmaf(p1.x, x0.z, a); a = fmaf(p1.y, x0.w, a);
                    a = fmaf(p2.x, x1.x, a); a = fmaf(p2.y, x1.y, a);
                    a = fmaf(p3.x, x1.z, a); a = fmaf(p3.y, x1.w, a);
                    acc[r][b] = a;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++) {
            float v = acc[r][b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
            acc[r][b] = v;
        }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
            if (n0 + r < N)
#pragma unroll
                for (int b = 0; b < B; b++) y[(size_t)b * N + n0 + r] = acc[r][b];
    }
}
