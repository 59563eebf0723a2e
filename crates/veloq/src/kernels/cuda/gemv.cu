// y[b][n] = Σ_k x[b][k]·W[n][k] for a few rows of activations (decode: one per sequence):
// W f16 row-major [N][K] (a model's weight matrix), x f32 [B][K], y f32. Bound by reading W once,
// so what matters is bytes in flight: a block's warps split each row's K between them (a warp
// streaming a whole row alone waits K/256 round trips; the 1024-row k/v projections of an 8B
// layer left most SMs idle that way), every thread issues its U 16-byte loads before using them,
// and the warps' partial sums meet in shared memory in a fixed order (deterministic: graphs
// replay the eager pass's numbers).
//
// The small operations around a decode step's products ride along, so a layer is four launches:
//   GATED 0: the rows of w, w2, w3 (N1, N2 and the rest of N rows; a block's rows never straddle
//            two, the host checks) are separate outputs, each [B][rows] one after the other in y
//            (a layer's q, k, v: each contiguous for any B);
//   GATED 1 (SiLU) / 2 (GELU, tanh form): a block takes the same rows of w (gate) and w2 (up) and
//            writes act(gate)·up, y [B][N] (the MLP's input to its down projection);
//   NORM:    x is RMS-normalised first (weights g [K], eps), as the norm before each product;
//   RES:     1: y = r + product (the residual stream, r laid out as y); 2: y += product (the
//            stream updated in place);
//   ROPE:    (head_dim) rows of w and w2 (q, k) rotated as pairs (2i, 2i+1) of each head, the
//            interleaved RoPE of Llama GGUFs, by each activation row's cos/sin [B][head_dim/2].
//
// Launched to overlap the previous kernel (launch.rs): a block signals its dependents on entry,
// prefetches its first weight chunks into L2 and waits for x's writer before anything else.
//
// f16_gemv (defines B 1..8, R rows per block, U, THREADS): f32 FMAs on f32 activations; the norm
// scale (Σx² gathered from the same loads) multiplies the sums at the end.
// f16_gemv_mma (defines B 1..8, G n8 tiles per block, U, THREADS): tensor cores, activations
// rounded to f16 (what the cuBLAS path did with them; normalised first, in a pass over x, so the
// rounding sees the values cuBLAS saw), f32 accumulation. The weights are the mma's B operand (8
// rows a tile), the activations its A (rows ≥ B are zero); a lane's 16-byte chunk of a weight row
// (8 consecutive k) feeds two m16n8k16 steps. Which k a fragment slot holds does not matter to a
// dot product as long as A and B agree, so lane (g, c) puts k 8c..8c+3 of the step's 32 in the
// first mma's slots (2c, 2c+1, 2c+8, 2c+9) and 8c+4..8c+7 in the second's.

#define WARPS (THREADS / 32)
#define MATS (GATED ? 2 : 1)  // matrices a block reads rows of

struct GemvArgs {
    const unsigned short* w;
    const unsigned short* w2;
    const unsigned short* w3;
    const float* x;
    float* y;
    const float* r;    // RES
    const float* g;    // NORM
    const float* cos;  // ROPE
    const float* sin;
    int N, N1, N2, K;
    float eps;
};

// Both kernels' parameters, in the host's order.
#define GEMV_PARAMS                                                                                 \
    const unsigned short *__restrict__ w, const unsigned short *__restrict__ w2,                     \
        const unsigned short *__restrict__ w3, const float *__restrict__ x, float *__restrict__ y,   \
        const float *__restrict__ res, const float *__restrict__ norm_w, const float *__restrict__ cos_rows, \
        const float *__restrict__ sin_rows, int N, int N1, int N2, int K, float eps
#define GEMV_ARGS GemvArgs{w, w2, w3, x, y, res, norm_w, cos_rows, sin_rows, N, N1, N2, K, eps}

__device__ __forceinline__ float act(float v) {
#if GATED == 1
    return v / (1.f + __expf(-v));
#else
    return 0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
#endif
}

// The matrix a block starting at output row n0 reads: its index, first row and height.
struct BlockMatrix {
    const unsigned short* w;
    int m, local, rows, start;
};

__device__ __forceinline__ BlockMatrix block_matrix(const GemvArgs& a, int n0) {
    if (GATED || n0 < a.N1) return {a.w, 0, n0, GATED ? a.N : a.N1, 0};
    if (n0 < a.N1 + a.N2) return {a.w2, 1, n0 - a.N1, a.N2, a.N1};
    return {a.w3, 2, n0 - a.N1 - a.N2, a.N - a.N1 - a.N2, a.N1 + a.N2};
}

// Writes outputs i (activation row b) of rows `local` and, with ROPE, `local + 1` of the block's
// matrix: rotation, residual, store.
__device__ __forceinline__ void store_pair(const GemvArgs& a, const BlockMatrix& bm, int b, int local, float v0,
                                           float v1, bool pair) {
#if ROPE
    if (pair && bm.m < 2) {
        const int p = (local % ROPE) / 2;
        const float c = a.cos[b * (ROPE / 2) + p], s = a.sin[b * (ROPE / 2) + p];
        const float r0 = v0 * c - v1 * s, r1 = v0 * s + v1 * c;
        v0 = r0;
        v1 = r1;
    }
#endif
    const size_t base = (size_t)bm.start * B + (size_t)b * bm.rows;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int n = local + e;
        if ((e == 1 && !pair) || n >= bm.rows) continue;
        float v = e ? v1 : v0;
#if RES == 1
        v += a.r[base + n];
#elif RES == 2
        v += a.y[base + n];
#endif
        a.y[base + n] = v;
    }
}

#ifdef R
extern "C" __global__ void __launch_bounds__(THREADS) f16_gemv(GEMV_PARAMS) {
    const GemvArgs a = GEMV_ARGS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * R;
    grid_launch_dependents();
    const BlockMatrix bm = block_matrix(a, n0);
    float acc[MATS * R][B];
    float ss[B];
#pragma unroll
    for (int b = 0; b < B; b++) {
        ss[b] = 0.f;
#pragma unroll
        for (int r = 0; r < MATS * R; r++) acc[r][b] = 0.f;
    }
    const uint4* wr[MATS * R];
#pragma unroll
    for (int r = 0; r < MATS * R; r++) {
        const int i = r % R, n = bm.local + i < bm.rows ? bm.local + i : bm.rows - 1;  // tail rows re-read the last
        wr[r] = reinterpret_cast<const uint4*>((r < R ? bm.w : a.w2) + (size_t)n * K);
    }
    const int chunks = K / 8;
    // Weights are never written: their first chunks are requested before waiting for the kernel
    // that writes x (launch.rs), so the memory stream does not stop between two products.
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = threadIdx.x + THREADS * u;
#pragma unroll
        for (int r = 0; r < MATS * R; r++)
            if (c < chunks) prefetch_l2(wr[r] + c);
    }
    grid_wait();
    // Chunk c of every row: the block's threads read THREADS consecutive chunks at a time.
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * U) {
        uint4 wv[U][MATS * R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + THREADS * u;
#pragma unroll
            for (int r = 0; r < MATS * R; r++) wv[u][r] = c < chunks ? __ldg(wr[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + THREADS * u;
            if (c >= chunks) break;
#pragma unroll
            for (int b = 0; b < B; b++) {
                const float4* xp = reinterpret_cast<const float4*>(a.x + (size_t)b * K + c * 8);
                float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
#if NORM
                ss[b] += x0.x * x0.x + x0.y * x0.y + x0.z * x0.z + x0.w * x0.w + x1.x * x1.x + x1.y * x1.y +
                         x1.z * x1.z + x1.w * x1.w;
                const float4* gp = reinterpret_cast<const float4*>(a.g + c * 8);
                const float4 g0 = __ldg(gp), g1 = __ldg(gp + 1);
                x0 = make_float4(x0.x * g0.x, x0.y * g0.y, x0.z * g0.z, x0.w * g0.w);
                x1 = make_float4(x1.x * g1.x, x1.y * g1.y, x1.z * g1.z, x1.w * g1.w);
#endif
#pragma unroll
                for (int r = 0; r < MATS * R; r++) {
                    const float2 p0 = unpack_h2(wv[u][r].x), p1 = unpack_h2(wv[u][r].y);
                    const float2 p2 = unpack_h2(wv[u][r].z), p3 = unpack_h2(wv[u][r].w);
                    float s = acc[r][b];
                    s = fmaf(p0.x, x0.x, s); s = fmaf(p0.y, x0.y, s);
                    s = fmaf(p1.x, x0.z, s); s = fmaf(p1.y, x0.w, s);
                    s = fmaf(p2.x, x1.x, s); s = fmaf(p2.y, x1.y, s);
                    s = fmaf(p3.x, x1.z, s); s = fmaf(p3.y, x1.w, s);
                    acc[r][b] = s;
                }
            }
        }
    }
    // Per warp: MATS·R·B sums, then (NORM) B sums of squares.
    __shared__ float part[WARPS][(MATS * R + NORM) * B];
#pragma unroll
    for (int b = 0; b < B; b++) {
#pragma unroll
        for (int r = 0; r < MATS * R; r++) {
            const float v = warp_sum(acc[r][b]);
            if (lane == 0) part[warp][r * B + b] = v;
        }
#if NORM
        const float v = warp_sum(ss[b]);
        if (lane == 0) part[warp][MATS * R * B + b] = v;
#endif
    }
    __syncthreads();
    // Output (row r, activation row b): the warps' sums in order, scaled, gated.
    auto value = [&](int r, int b) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) s += part[v][r * B + b];
#if NORM
        float q = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) q += part[v][MATS * R * B + b];
        const float scale = rsqrtf(q / K + a.eps);
        s *= scale;
#endif
#if GATED
        float u = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) u += part[v][(R + r) * B + b];
#if NORM
        u *= scale;
#endif
        s = act(s) * u;
#endif
        return s;
    };
    // Rows in pairs (RoPE rotates pairs; R is even then, the host checks).
    for (int i = threadIdx.x; i < (R + 1) / 2 * B; i += THREADS) {
        const int r = 2 * (i / B), b = i % B;
        const bool pair = r + 1 < R;
        store_pair(a, bm, b, bm.local + r, value(r, b), pair ? value(r + 1, b) : 0.f, pair);
    }
}
#endif

#ifdef G
extern "C" __global__ void __launch_bounds__(THREADS) f16_gemv_mma(GEMV_PARAMS) {
    const GemvArgs a = GEMV_ARGS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int n0 = blockIdx.x * 8 * G;
    grid_launch_dependents();
    const BlockMatrix bm = block_matrix(a, n0);
    const unsigned short* wr[MATS * G];
#pragma unroll
    for (int j = 0; j < MATS * G; j++) {
        const int n = bm.local + 8 * (j % G) + g;
        wr[j] = (j < G ? bm.w : a.w2) + (size_t)(n < bm.rows ? n : bm.rows - 1) * K;  // tail rows re-read the last
    }
    const int steps = (K + 31) / 32;
    // The first weight chunks requested before waiting for x's writer (as in f16_gemv).
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int k = (warp + WARPS * u) * 32 + 8 * c;
#pragma unroll
        for (int j = 0; j < MATS * G; j++)
            if (warp + WARPS * u < steps && k < K) prefetch_l2(wr[j] + k);
    }
    grid_wait();

#if NORM
    // Each activation row's 1/rms, before anything is rounded to f16.
    __shared__ float inv_rms[B];
    for (int b = warp; b < B; b += WARPS) {
        float q = 0.f;
        for (int k = lane * 4; k < K; k += 128) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(a.x + (size_t)b * K + k));
            q += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        q = warp_sum(q);
        if (lane == 0) inv_rms[b] = rsqrtf(q / K + a.eps);
    }
    __syncthreads();
    const float scale = g < B ? inv_rms[g] : 0.f;
#endif
    float acc[MATS * G][4];
#pragma unroll
    for (int j = 0; j < MATS * G; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const float* xr = a.x + (size_t)(g < B ? g : 0) * K;
    for (int s0 = warp; s0 < steps; s0 += WARPS * U) {
        uint4 wv[U][MATS * G], xv[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = (s0 + WARPS * u) * 32 + 8 * c;
            const bool ok = s0 + WARPS * u < steps && k < K;
#pragma unroll
            for (int j = 0; j < MATS * G; j++)
                wv[u][j] = ok ? __ldg(reinterpret_cast<const uint4*>(wr[j] + k)) : make_uint4(0, 0, 0, 0);
            if (ok && g < B) {
                float4 p = __ldg(reinterpret_cast<const float4*>(xr + k));
                float4 q = __ldg(reinterpret_cast<const float4*>(xr + k + 4));
#if NORM
                const float4 g0 = __ldg(reinterpret_cast<const float4*>(a.g + k));
                const float4 g1 = __ldg(reinterpret_cast<const float4*>(a.g + k + 4));
                p = make_float4(p.x * g0.x * scale, p.y * g0.y * scale, p.z * g0.z * scale, p.w * g0.w * scale);
                q = make_float4(q.x * g1.x * scale, q.y * g1.y * scale, q.z * g1.z * scale, q.w * g1.w * scale);
#endif
                xv[u] = make_uint4(pack_h2(p.x, p.y), pack_h2(p.z, p.w), pack_h2(q.x, q.y), pack_h2(q.z, q.w));
            } else {
                xv[u] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < MATS * G; j++) {
                mma_16816(acc[j], xv[u].x, 0u, xv[u].y, 0u, wv[u][j].x, wv[u][j].y);
                mma_16816(acc[j], xv[u].z, 0u, xv[u].w, 0u, wv[u][j].z, wv[u][j].w);
            }
    }
    // acc[j][0..1]: activation row g, weight rows local + 8j + 2c and + 1 (rows g + 8 of A are zero).
    __shared__ float part[WARPS][MATS * G * 64];
#pragma unroll
    for (int j = 0; j < MATS * G; j++) {
        part[warp][j * 64 + lane * 2] = acc[j][0];
        part[warp][j * 64 + lane * 2 + 1] = acc[j][1];
    }
    __syncthreads();
    auto value = [&](int i) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) s += part[v][i];
#if GATED
        float u = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) u += part[v][G * 64 + i];
        s = act(s) * u;
#endif
        return s;
    };
    // One (tile j, lane l) per iteration: its two adjacent rows, a RoPE pair.
    for (int i = threadIdx.x; i < G * 32; i += THREADS) {
        const int j = i / 32, l = i % 32, b = l >> 2;
        if (b < B) store_pair(a, bm, b, bm.local + 8 * j + 2 * (l & 3), value(2 * i), value(2 * i + 1), true);
    }
}
#endif
