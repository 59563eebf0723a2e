// Fused decode attention over VecInfer codes (flash-decoding split over the sequence).
//
// vq_attend_split: block (head group, split, b·HKV + h) for GB of the G query heads that share kv
// head h. For each of its heads it rotates the query into code space (q̃ = H(s ⊙ q·scale)) and
// builds the lookup table LUT[j][c] = q̃_j·C[c] in shared memory. Pass 1 reads each token's key
// codes once (16-byte loads) and scores it for all GB heads by M_K table lookups (+ q·μ, the key
// centering). Pass 2 turns scores into softmax weights. Pass 3 stages value codes in shared memory;
// a lane takes one sub-space of one token, loads its centroid row once and accumulates it into
// all GB heads. It writes a partial (max, sum, D-vector in
// code space) per head. Codes are the only cache bytes read, once per group; no fp16 key or value
// is written anywhere.
//
// vq_attend_merge: block (q head, b). Merges the splits, attends exactly over the f16 window,
// rotates the code-space sum back (H, value scale, + μ_v times its softmax mass), normalises.
//
// Defines: D, M_K, SD_K, K_K (key centroids, 8-bit codes), M_V, SD_V, K_V, HQ, HKV, G (= HQ/HKV),
// GB (heads per block, divides G), CENTER_K, SMOOTH_K, CENTER_V, SMOOTH_V, ROTATE, MAX_SPLIT,
// TABLE (floats of the table space), CHUNK, THREADS. Layouts: q [B][HQ][D] f32; codes [B][HKV][S][M] u8; window [B][HKV][W][D] f16.

// s[g] += table entry e for every head g (entries laid out [e][g]; 8/16-byte loads for GB 2/4).
__device__ __forceinline__ void add_entry(float (&s)[GB], const float* lut, int e) {
#if GB == 4
    const float4 v = *(const float4*)(lut + e * 4);
    s[0] += v.x; s[1] += v.y; s[2] += v.z; s[3] += v.w;
#elif GB == 2
    const float2 v = *(const float2*)(lut + e * 2);
    s[0] += v.x; s[1] += v.y;
#else
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] += lut[e * GB + g];
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) vq_attend_split(
    const float* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const float* __restrict__ kbook, const float* __restrict__ vbook, const float* __restrict__ kmean,
    const float* __restrict__ kscale, float* __restrict__ part_o, float* __restrict__ part_ml, int S, int split, float scale) {
    extern __shared__ __align__(16) float smem[];
    float* lut = smem;                          // [M_K][K_K][GB], later staged codes and partials
    float* p = lut + TABLE;                     // [GB][MAX_SPLIT]
    float* vb = p + GB * MAX_SPLIT;             // [K_V][SD_V]
    float* qt = vb + K_V * SD_V;                // [GB][D]
    float* red = qt + GB * D;                   // [GB][32]: offsets, maxima, sums
    const int gi = blockIdx.x, sp = blockIdx.y, bh = blockIdx.z;
    const int h = bh % HKV, b = bh / HKV, qh0 = h * G + gi * GB;
    const int nsplit = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = THREADS / 32;
    const int t0 = sp * split, t1 = min(S, t0 + split), n = max(0, t1 - t0);

    for (int i = tid; i < K_V * SD_V; i += THREADS) vb[i] = vbook[i];
    for (int g = warp; g < GB; g += nwarps) {
        float v[D / 32];
        float off = 0.f;
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int e = i * 32 + lane;
            float f = q[((size_t)b * HQ + qh0 + g) * D + e] * scale;
            if (CENTER_K) off = fmaf(f, kmean[h * D + e], off);
            if (SMOOTH_K) f *= kscale[h * D + e];
            v[i] = f;
        }
        if (ROTATE) warp_fwht<D>(v, lane);
#pragma unroll
        for (int i = 0; i < D / 32; i++) qt[g * D + i * 32 + lane] = v[i];
        off = warp_sum(off);
        if (lane == 0) red[g * 32 + 31] = off;
    }
    __syncthreads();
    // Table layout [j][c][g]: one vector load fetches every head's entry for a code.
    for (int i = tid; i < GB * M_K * K_K; i += THREADS) {
        const int g = i % GB, c = (i / GB) % K_K, j = i / (GB * K_K);
        float acc = (j == 0) ? red[g * 32 + 31] : 0.f;
#pragma unroll
        for (int d = 0; d < SD_K; d++) acc = fmaf(qt[g * D + j * SD_K + d], kbook[c * SD_K + d], acc);
        lut[i] = acc;
    }
    __syncthreads();

    // Pass 1: scores, key codes read once per token for all GB heads.
    const unsigned char* kc = kcodes + ((size_t)(b * HKV + h) * S) * M_K;
    float mx[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) mx[g] = -3.402823466e38f;
#pragma unroll 2
    for (int t = tid; t < n; t += THREADS) {
        float s[GB];
#pragma unroll
        for (int g = 0; g < GB; g++) s[g] = 0.f;
#if M_K % 16 != 0
#pragma unroll
        for (int j = 0; j < M_K; j++) {
            const int code = kc[(size_t)(t0 + t) * M_K + j];
            add_entry(s, lut, j * K_K + code);
        }
#else
        const uint4* row = (const uint4*)(kc + (size_t)(t0 + t) * M_K);
#pragma unroll
        for (int w = 0; w < M_K / 16; w++) {
            const uint4 u = row[w];
            const unsigned int words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
#pragma unroll
                for (int by = 0; by < 4; by++) {
                    const int j = w * 16 + k * 4 + by;
                    const int code = (words[k] >> (8 * by)) & 0xff;
                    add_entry(s, lut, j * K_K + code);
                }
            }
        }
#endif
#pragma unroll
        for (int g = 0; g < GB; g++) {
            p[g * MAX_SPLIT + t] = s[g];
            mx[g] = fmaxf(mx[g], s[g]);
        }
    }
    // Pass 2: block maxima and sums per head, weights in place.
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GB; g++) {
        const float m = warp_max(mx[g]);
        if (lane == 0) red[g * 32 + warp] = m;
    }
    __syncthreads();
    float sum[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) {
        float m = red[g * 32];
        for (int w = 1; w < nwarps; w++) m = fmaxf(m, red[g * 32 + w]);
        mx[g] = m;
        sum[g] = 0.f;
    }
    __syncthreads();
    for (int t = tid; t < n; t += THREADS) {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            const float e = __expf(p[g * MAX_SPLIT + t] - mx[g]);
            p[g * MAX_SPLIT + t] = e;
            sum[g] += e;
        }
    }
#pragma unroll
    for (int g = 0; g < GB; g++) {
        const float v = warp_sum(sum[g]);
        if (lane == 0) red[g * 32 + warp] = v;
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GB; g++) {
        float v = 0.f;
        for (int w = 0; w < nwarps; w++) v += red[g * 32 + w];
        sum[g] = v;
    }

    // Pass 3: value codes of CHUNK tokens staged in shared memory with 16-byte loads. A lane owns
    // sub-space j of one token at a time: it reads the code, the centroid row (one vector load)
    // and each head's weight, and accumulates SD_V dims for every head of the group. Partials of
    // the warps' token subsets are summed at the end.
    const unsigned char* vc = vcodes + ((size_t)(b * HKV + h) * S) * M_V;
    constexpr int LPT = M_V < 32 ? M_V : 32;  // lanes per token
    constexpr int TPW = 32 / LPT;             // tokens per warp step
    constexpr int JPL = M_V / LPT;            // sub-spaces per lane
    constexpr int SLOTS = (THREADS / 32) * TPW;
    const int slot = warp * TPW + lane / LPT, jl = lane % LPT;
    unsigned char* vs = (unsigned char*)lut;  // [CHUNK][M_V], in the table space
    float acc[GB][JPL][SD_V];
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int jj = 0; jj < JPL; jj++)
#pragma unroll
            for (int dd = 0; dd < SD_V; dd++) acc[g][jj][dd] = 0.f;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = min(CHUNK, n - c0);
        __syncthreads();
#if M_V % 16 == 0
        const uint4* src = (const uint4*)(vc + (size_t)(t0 + c0) * M_V);
        for (int i = tid; i < cn * M_V / 16; i += THREADS) ((uint4*)vs)[i] = src[i];
#else
        for (int i = tid; i < cn * M_V; i += THREADS) vs[i] = vc[(size_t)(t0 + c0) * M_V + i];
#endif
        __syncthreads();
#pragma unroll 2
        for (int t = slot; t < cn; t += SLOTS) {
            float pw[GB];
#pragma unroll
            for (int g = 0; g < GB; g++) pw[g] = p[g * MAX_SPLIT + c0 + t];
#pragma unroll
            for (int jj = 0; jj < JPL; jj++) {
                const int code = vs[t * M_V + jl + jj * LPT];
                float c[SD_V];
#if SD_V == 4
                const float4 cv = *(const float4*)(vb + code * 4);
                c[0] = cv.x; c[1] = cv.y; c[2] = cv.z; c[3] = cv.w;
#else
#pragma unroll
                for (int dd = 0; dd < SD_V; dd++) c[dd] = vb[code * SD_V + dd];
#endif
#pragma unroll
                for (int g = 0; g < GB; g++)
#pragma unroll
                    for (int dd = 0; dd < SD_V; dd++) acc[g][jj][dd] = fmaf(pw[g], c[dd], acc[g][jj][dd]);
            }
        }
    }
    __syncthreads();
    float* obuf = lut;  // slot partials [SLOTS][GB][D]
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int jj = 0; jj < JPL; jj++)
#pragma unroll
            for (int dd = 0; dd < SD_V; dd++) obuf[(slot * GB + g) * D + (jl + jj * LPT) * SD_V + dd] = acc[g][jj][dd];
    __syncthreads();
    for (int i = tid; i < GB * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float o = 0.f;
        for (int sl = 0; sl < SLOTS; sl++) o += obuf[(sl * GB + g) * D + d];
        const size_t part = (size_t)(b * HQ + qh0 + g) * nsplit + sp;
        part_o[part * D + d] = o;
        if (d == 0) {
            part_ml[part * 2] = n > 0 ? mx[g] : -3.402823466e38f;
            part_ml[part * 2 + 1] = n > 0 ? sum[g] : 0.f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) vq_attend_merge(
    const float* __restrict__ q, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    const unsigned short* __restrict__ wk, const unsigned short* __restrict__ wv, const float* __restrict__ vmean,
    const float* __restrict__ vscale, float* __restrict__ out, int nsplit, int W, float scale) {
    __shared__ float oc[D];
    __shared__ float ws[64];
    __shared__ float red[2];
    const int qh = blockIdx.x, b = blockIdx.y, h = qh / G;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t base = (size_t)(b * HQ + qh) * nsplit;
    // Window scores, one warp per window position.
    for (int t = warp; t < W; t += blockDim.x >> 5) {
        float s = 0.f;
        for (int e = lane; e < D; e += 32)
            s = fmaf(q[((size_t)b * HQ + qh) * D + e] * scale, h2f(wk[(((size_t)b * HKV + h) * W + t) * D + e]), s);
        s = warp_sum(s);
        if (lane == 0) ws[t] = s;
    }
    __syncthreads();
    if (tid == 0) {
        float m = -3.402823466e38f;
        for (int s = 0; s < nsplit; s++) m = fmaxf(m, part_ml[(base + s) * 2]);
        for (int t = 0; t < W; t++) m = fmaxf(m, ws[t]);
        float lc = 0.f, lw = 0.f;
        for (int s = 0; s < nsplit; s++) lc += part_ml[(base + s) * 2 + 1] * __expf(part_ml[(base + s) * 2] - m);
        for (int t = 0; t < W; t++) { ws[t] = __expf(ws[t] - m); lw += ws[t]; }
        red[0] = m;
        red[1] = lc;
        ws[63] = lw;
    }
    __syncthreads();
    const float m = red[0], lc = red[1], lw = ws[63];
    for (int d = tid; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < nsplit; s++) acc += part_o[(base + s) * D + d] * __expf(part_ml[(base + s) * 2] - m);
        oc[d] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        float v[D / 32];
#pragma unroll
        for (int i = 0; i < D / 32; i++) v[i] = oc[i * 32 + lane];
        if (ROTATE) warp_fwht<D>(v, lane);
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int e = i * 32 + lane;
            float f = v[i];
            if (SMOOTH_V) f *= vscale[h * D + e];
            if (CENTER_V) f = fmaf(lc, vmean[h * D + e], f);
            oc[e] = f;
        }
    }
    __syncthreads();
    const float inv = 1.f / (lc + lw);
    for (int d = tid; d < D; d += blockDim.x) {
        float acc = oc[d];
        for (int t = 0; t < W; t++) acc = fmaf(ws[t], h2f(wv[(((size_t)b * HKV + h) * W + t) * D + d]), acc);
        out[((size_t)b * HQ + qh) * D + d] = acc * inv;
    }
}
