// Flash-decoding over f16 keys and values: the fp16 cache's decode attention, built like veloq's
// code kernels (split over the sequence, merge), so the end-to-end comparison is kernel against
// kernel. f32 scores, softmax and accumulation.
//
// Defines: D, G (query heads per kv head), HKV, HQ, THREADS.
// Layout: k, v [streams][stride][D] f16 (stream = b·HKV + kv head), q [B][HQ][D] f32; query head
// h·G + g reads kv head h.
//
// A ragged batch (`seqs` not null: sequences at different positions, one launch): sequence b's
// entry seqs[3b..3b+3] is its slot (streams slot·HKV + h), its query row (of q and out) and its
// length, which replaces S; splits past a sequence's length write empty partials.

constexpr int LPP = 8;          // lanes per key row in the score pass
constexpr int EPL = D / LPP;    // elements per lane (a multiple of 8: whole 16-byte loads)
constexpr int VL = D / 8;                // lanes per value row (16-byte loads)
constexpr int NGRP = THREADS / VL;       // position groups in the value pass

extern "C" __global__ void __launch_bounds__(THREADS) f16_attend_split(
    const float* __restrict__ q, const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
    float* __restrict__ part_o, float* __restrict__ part_ml, int S, long long stride, int split, float scale, int fresh,
    const int* __restrict__ seqs) {
    extern __shared__ __align__(16) float sc[];  // [G][split] scores, then weights; then [NGRP][G][D]
    __shared__ float qs[G][D];
    __shared__ float red[G][THREADS / 32];
    __shared__ float stat[G][2];
    const int sp = blockIdx.x, b = blockIdx.y / HKV, h = blockIdx.y % HKV;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nsplit = gridDim.x;
    const int qrow = seqs ? seqs[3 * b + 1] : b;
    const size_t bh = seqs ? (size_t)seqs[3 * b] * HKV + h : blockIdx.y;
    if (seqs) S = seqs[3 * b + 2];
    const int t0 = sp * split, n = max(0, min(S, t0 + split) - t0);
    // Overlapped launch (launch.rs): the kernel before may have written rows from `fresh` on
    // (0: anything), so only the blocks that read those wait for it.
    grid_launch_dependents();
    if (fresh == 0 || t0 + n > fresh) grid_wait();
    for (int i = tid; i < G * D; i += THREADS) qs[i / D][i % D] = q[((size_t)qrow * HQ + h * G + i / D) * D + i % D] * scale;
    __syncthreads();
    const unsigned short* kb = k + (bh * stride + t0) * D;
    const int sub = tid % LPP;
    // Each lane's slice of the queries in registers (shared-memory reads here would conflict:
    // the 8 lanes of a row sit EPL floats apart).
    float qr[G][EPL];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int e = 0; e < EPL; e++) qr[g][e] = qs[g][sub * EPL + e];
    // Two rows per lane group per pass (both rows' loads in flight together). The loop bound is
    // the same for the whole block: every lane reaches the shuffles.
    constexpr int RPP = THREADS / LPP;  // rows per pass and per half
    for (int base = 0; base < n; base += 2 * RPP) {
        float acc[2][G];
        uint4 u[2][EPL / 8];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int i = base + r * RPP + tid / LPP;
            const uint4* row = (const uint4*)(kb + (size_t)min(i, n - 1) * D + sub * EPL);
#pragma unroll
            for (int c = 0; c < EPL / 8; c++) u[r][c] = row[c];
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int g = 0; g < G; g++) acc[r][g] = 0.f;
#pragma unroll
            for (int c = 0; c < EPL / 8; c++) {
                const unsigned int w[4] = {u[r][c].x, u[r][c].y, u[r][c].z, u[r][c].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = unpack_h2(w[j]);
                    const int e = c * 8 + 2 * j;
#pragma unroll
                    for (int g = 0; g < G; g++) acc[r][g] = fmaf(f.x, qr[g][e], fmaf(f.y, qr[g][e + 1], acc[r][g]));
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
#pragma unroll
                for (int o = LPP / 2; o > 0; o >>= 1) acc[r][g] += __shfl_xor_sync(FULL_MASK, acc[r][g], o);
            }
            const int i = base + r * RPP + tid / LPP;
            if (i < n && sub == 0) {
#pragma unroll
                for (int g = 0; g < G; g++) sc[g * split + i] = acc[r][g];
            }
        }
    }
    __syncthreads();
    // Per-head maximum and sum over this split; weights in place.
#pragma unroll
    for (int g = 0; g < G; g++) {
        float m = -3.402823466e38f;
        for (int i = tid; i < n; i += THREADS) m = fmaxf(m, sc[g * split + i]);
        m = warp_max(m);
        if (lane == 0) red[g][warp] = m;
    }
    __syncthreads();
    if (tid < G) {
        float m = -3.402823466e38f;
        for (int w = 0; w < THREADS / 32; w++) m = fmaxf(m, red[tid][w]);
        stat[tid][0] = m;
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float m = stat[g][0];
        float l = 0.f;
        for (int i = tid; i < n; i += THREADS) {
            const float p = __expf(sc[g * split + i] - m);
            sc[g * split + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) red[g][warp] = l;
    }
    __syncthreads();
    if (tid < G) {
        float l = 0.f;
        for (int w = 0; w < THREADS / 32; w++) l += red[tid][w];
        stat[tid][1] = l;
    }
    // Values: thread (grp, c) owns dims 8c .. 8c+7 over positions grp, grp + NGRP, … (16-byte
    // loads, four rows in flight per thread).
    const int c8 = tid % VL, grp = tid / VL;
    const uint4* vb = (const uint4*)(v + (bh * stride + t0) * D) + c8;
    float o[G][8];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[g][j] = 0.f;
#pragma unroll 4
    for (int i = grp; i < n; i += NGRP) {
        const uint4 u = vb[(size_t)i * VL];
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = unpack_h2(w[j]);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float p = sc[g * split + i];
                o[g][2 * j] = fmaf(p, f.x, o[g][2 * j]);
                o[g][2 * j + 1] = fmaf(p, f.y, o[g][2 * j + 1]);
            }
        }
    }
    __syncthreads();
    float* ob = sc;  // [NGRP][G][D], the weights are no longer read
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) ob[(grp * G + g) * D + 8 * c8 + j] = o[g][j];
    __syncthreads();
    for (int i = tid; i < G * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float s = 0.f;
        for (int r = 0; r < NGRP; r++) s += ob[(r * G + g) * D + d];
        const size_t part = ((size_t)b * HQ + h * G + g) * nsplit + sp;
        part_o[part * D + d] = s;
        if (d == 0) {
            part_ml[part * 2] = n > 0 ? stat[g][0] : -3.402823466e38f;
            part_ml[part * 2 + 1] = n > 0 ? stat[g][1] : 0.f;
        }
    }
}

// out[b][qh] = Σ_s e^{m_s − M} o_s / Σ_s e^{m_s − M} l_s (row seqs[3b + 1] of a ragged batch).
// Grid (HQ, B), 128 threads.
extern "C" __global__ void __launch_bounds__(128) f16_attend_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, float* __restrict__ out, int nsplit,
    const int* __restrict__ seqs) {
    extern __shared__ float w[];  // [nsplit]
    __shared__ float red[4];
    const int qh = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    grid_wait();  // the split kernel's partials
    const size_t base = ((size_t)b * HQ + qh) * nsplit;
    float m = -3.402823466e38f;
    for (int s = tid; s < nsplit; s += 128) m = fmaxf(m, part_ml[(base + s) * 2]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    float l = 0.f;
    for (int s = tid; s < nsplit; s += 128) {
        const float e = __expf(part_ml[(base + s) * 2] - m);
        w[s] = e;
        l += e * part_ml[(base + s) * 2 + 1];
    }
    l = warp_sum(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    const float inv = 1.f / (red[0] + red[1] + red[2] + red[3]);
    for (int d = tid; d < D; d += 128) {
        float acc = 0.f;
        for (int s = 0; s < nsplit; s++) acc = fmaf(w[s], part_o[(base + s) * D + d], acc);
        out[((size_t)(seqs ? seqs[3 * b + 1] : b) * HQ + qh) * D + d] = acc * inv;
    }
}
