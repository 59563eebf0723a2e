// Fused VecInfer quantize: f16 head vectors → centering,
// smoothing, Hadamard, nearest-centroid search (‖c‖² − 2x·c, running argmin in registers, ties to
// the lowest index), packed codes. One launch, no intermediate in device memory.
//
// Defines: D, SD, K (centroids), BITS, M (= D/SD, a multiple of 8), BOOKS (1 or M), HEADS, ROWS
// (rows per tile), CENTER, SMOOTH, ROTATE.
//
// Block: tiles of `tile_rows` ≤ ROWS rows (the host makes them smaller when there are few rows, so a
// flush of a few ring rows spreads over the multiprocessors instead of one block). Phase A: each warp transforms rows into shared memory. Phase B:
// every thread searches (row, sub-space) pairs two at a time against the codebook in shared
// memory (all lanes read the same centroid at once: a broadcast, used for both). Phase C: groups of 8 codes are packed
// into BITS bytes each (8 codes always end on a byte boundary).
//
// Rows: row r is vector t = r mod T of stream bh = r / T (kv head bh mod HEADS); it is read from
// row bh·in_hs + (in_base + t)·in_ts of x and its codes go to row bh·out_hs + (out_base + t)·out_ts
// of out (M·BITS/8 bytes per row). Token-major [tokens][HEADS] is hs = 1, ts = HEADS; a cache's
// head-major [streams][capacity] is hs = capacity, ts = 1. With in_wrap > 0 the input is a ring:
// row in_off + (in_base + t) mod in_wrap of the stream.
struct RowMap {
    int t;
    long long in_hs;
    int in_ts, in_base;
    long long out_hs;
    int out_ts, out_base;
    int in_wrap, in_off;
    __device__ size_t in_row(int r) const {
        const int i = in_wrap > 0 ? in_off + (in_base + r % t) % in_wrap : in_base + r % t;
        return (size_t)(r / t) * in_hs + (size_t)i * in_ts;
    }
    __device__ size_t out_row(int r) const { return (size_t)(r / t) * out_hs + (size_t)(out_base + r % t) * out_ts; }
    __device__ int head(int r) const { return (r / t) % HEADS; }
};

extern "C" __global__ void __launch_bounds__(256) vq_quantize(
    const unsigned short* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ inv_scale,
    const float* __restrict__ books, const float* __restrict__ norms, unsigned char* __restrict__ out, int n_rows, int tile_rows, RowMap map) {
    extern __shared__ float smem[];
    float* cb = smem;                                   // [BOOKS][K][SD]
    float* nb = cb + BOOKS * K * SD;                    // [BOOKS][K]
    float* tile = nb + BOOKS * K;                       // [ROWS][D]
    unsigned short* codes = (unsigned short*)(tile + ROWS * D);  // [ROWS * M]
    for (int i = threadIdx.x; i < BOOKS * K * SD; i += blockDim.x) cb[i] = books[i];
    for (int i = threadIdx.x; i < BOOKS * K; i += blockDim.x) nb[i] = norms[i];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int row0 = blockIdx.x * tile_rows; row0 < n_rows; row0 += gridDim.x * tile_rows) {
        const int rows = min(tile_rows, n_rows - row0);
        for (int r = warp; r < rows; r += nwarps) {
            const int row = row0 + r, head = map.head(row);
            const size_t src = map.in_row(row);
            float v[D / 32];
#pragma unroll
            for (int i = 0; i < D / 32; i++) {
                const int e = i * 32 + lane;
                float f = h2f(x[src * D + e]);
                if (CENTER) f -= mean[head * D + e];
                if (SMOOTH) f *= inv_scale[head * D + e];
                v[i] = f;
            }
            if (ROTATE) warp_fwht<D>(v, lane);
#pragma unroll
            for (int i = 0; i < D / 32; i++) tile[r * D + i * 32 + lane] = v[i];
        }
        __syncthreads();
        // Two sub-vectors per thread share every centroid read from shared memory.
        for (int p0 = threadIdx.x; p0 < rows * M; p0 += 2 * blockDim.x) {
            const int p1 = p0 + blockDim.x;
            const bool two = p1 < rows * M;
            const int j0 = p0 % M, j1 = two ? p1 % M : j0;
            float x0[SD], x1[SD];
#pragma unroll
            for (int d = 0; d < SD; d++) {
                x0[d] = tile[(p0 / M) * D + j0 * SD + d];
                x1[d] = two ? tile[(p1 / M) * D + j1 * SD + d] : 0.f;
            }
            float best0 = 3.402823466e38f, best1 = 3.402823466e38f;
            int bi0 = 0, bi1 = 0;
            if (BOOKS == 1) {
                for (int k = 0; k < K; k++) {
                    float d0 = 0.f, d1 = 0.f;
#pragma unroll
                    for (int d = 0; d < SD; d++) {
                        const float c = cb[k * SD + d];
                        d0 = fmaf(x0[d], c, d0);
                        d1 = fmaf(x1[d], c, d1);
                    }
                    const float n = nb[k];
                    d0 = fmaf(-2.f, d0, n);
                    d1 = fmaf(-2.f, d1, n);
                    if (d0 < best0) { best0 = d0; bi0 = k; }
                    if (d1 < best1) { best1 = d1; bi1 = k; }
                }
            } else {
                for (int k = 0; k < K; k++) {
                    float d0 = 0.f, d1 = 0.f;
#pragma unroll
                    for (int d = 0; d < SD; d++) {
                        d0 = fmaf(x0[d], cb[(j0 * K + k) * SD + d], d0);
                        d1 = fmaf(x1[d], cb[(j1 * K + k) * SD + d], d1);
                    }
                    d0 = fmaf(-2.f, d0, nb[j0 * K + k]);
                    d1 = fmaf(-2.f, d1, nb[j1 * K + k]);
                    if (d0 < best0) { best0 = d0; bi0 = k; }
                    if (d1 < best1) { best1 = d1; bi1 = k; }
                }
            }
            if (BITS == 8) {
                out[map.out_row(row0 + p0 / M) * M + j0] = (unsigned char)bi0;
                if (two) out[map.out_row(row0 + p1 / M) * M + j1] = (unsigned char)bi1;
            } else {
                codes[p0] = (unsigned short)bi0;
                if (two) codes[p1] = (unsigned short)bi1;
            }
        }
        if (BITS != 8) {
            __syncthreads();
            for (int g = threadIdx.x; g < rows * M / 8; g += blockDim.x) {
                unsigned long long acc = 0;
                int filled = 0;
                size_t pos = map.out_row(row0 + g * 8 / M) * (M / 8 * BITS) + (g * 8 % M) / 8 * BITS;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc |= (unsigned long long)codes[g * 8 + i] << filled;
                    filled += BITS;
                    while (filled >= 8) { out[pos++] = (unsigned char)(acc & 0xff); acc >>= 8; filled -= 8; }
                }
            }
        }
        __syncthreads();
    }
}
