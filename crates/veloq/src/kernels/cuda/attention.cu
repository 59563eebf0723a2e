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
// vq_attend_merge (merge.cu) finishes from the partials.
//
// A ragged batch (sequences at different positions, `is_ragged`) is one launch too: the table of
// 8 ints per sequence that the tensor-core kernel reads (attention_mma.cu) gives sequence b its
// slot, packed query row and coded length; splits past a sequence's end write empty partials
// (no table built, nothing read), which the merge weighs by zero.
//
// Defines: D, M_K, SD_K, K_K (key centroids, 8-bit codes), M_V, SD_V, K_V, HQ, HKV, G (= HQ/HKV),
// GB (heads per block, divides G), CENTER_K, SMOOTH_K, CENTER_V, SMOOTH_V, ROTATE, MAX_SPLIT,
// TABLE (floats of the table space), CHUNK, THREADS, GBP (table entry width), PJ (sub-spaces
// interleaved in the table), RV (value codebook replicas), VALUES_F16 (value pass in packed f16).
// Layouts: q [B][HQ][D] f32; codes [B][HKV][S][M] u8 (ragged: [slots][HKV][stride][M], q's rows
// packed).

// Shared-memory layouts are chosen so that the lanes of one load phase hit distinct banks even
// though codes are random: a table entry (all heads of one (j, c)) is GBP floats, and PJ sub-spaces
// are interleaved per code, entry (j, c) at ((j / PJ) · K_K + c) · PJ + j % PJ. A lane starts its
// token at sub-space (lane mod PJ) and walks them cyclically, so the PJ lanes of a phase always read
// PJ different banks. The value codebook is likewise replicated RV times, lane jl reading copy jl mod RV.

// s[g] += the GB heads' entries at e (GBP floats, 8/16-byte loads).
__device__ __forceinline__ void add_entry(float (&s)[GB], const float* e) {
#if GBP == 4
    const float4 v = *(const float4*)e;
    s[0] += v.x;
#if GB > 1
    s[1] += v.y;
#endif
#if GB > 2
    s[2] += v.z;
#endif
#if GB > 3
    s[3] += v.w;
#endif
#elif GBP == 2
    const float2 v = *(const float2*)e;
    s[0] += v.x; s[1] += v.y;
#else
    s[0] += e[0];
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) vq_attend_split(
    const float* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const float* __restrict__ kbook, const float* __restrict__ vbook, const float* __restrict__ kmean,
    const float* __restrict__ kscale, float* __restrict__ part_o, float* __restrict__ part_ml, int S, long long stride, int split, float scale,
    const int* __restrict__ ragged, int is_ragged) {
    extern __shared__ __align__(16) float smem[];
    float* lut = smem;                          // [M_K/PJ][K_K][PJ][GBP], later staged codes and partials
    float* p = lut + TABLE;                     // [MAX_SPLIT][GBP]
    constexpr int VB_WORDS = VALUES_F16 ? SD_V / 2 : SD_V;  // 32-bit words per centroid
    float* vb = p + GBP * MAX_SPLIT;            // [K_V][RV][VB_WORDS]
    float* qt = vb + K_V * RV * VB_WORDS;       // [GB][D]
    float* red = qt + GB * D;                   // [GB][32]: offsets, maxima, sums
    const int gi = blockIdx.x, sp = blockIdx.y, bh = blockIdx.z;
    const int h = bh % HKV, b = bh / HKV, qh0 = h * G + gi * GB;
    const int nsplit = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = THREADS / 32;
    // Sequence b's codes slot, query row and coded length: its own outside a ragged batch.
    const int cs = is_ragged ? ragged[8 * b] : b, qb = is_ragged ? ragged[8 * b + 1] : b;
    const int t0 = sp * split, t1 = min(is_ragged ? ragged[8 * b + 2] : S, t0 + split), n = max(0, t1 - t0);
    if (n == 0) {  // a split past the sequence's end (the same for the whole block)
        for (int i = tid; i < GB * D; i += THREADS) {
            const size_t part = (size_t)(b * HQ + qh0 + i / D) * nsplit + sp;
            part_o[part * D + i % D] = 0.f;
            if (i % D < 2) part_ml[part * 2 + i % D] = i % D == 0 ? -3.402823466e38f : 0.f;
        }
        return;
    }

#if GBP * MAX_SPLIT < K_K * SD_K
#error "the key codebook is staged in the weights' space"
#endif
    float* kb = p;  // [K_K][SD_K] key codebook while the table is built
    // Codebooks into shared memory: every load of a thread is issued before its stores (one
    // round trip), and the lanes of a phase write distinct replicas (no bank conflicts).
#pragma unroll
    for (int k = 0; k < (K_V * RV + THREADS - 1) / THREADS; k++) {
        const int i = tid + k * THREADS;  // (centroid, replica) = (i / RV, i mod RV)
        if (i < K_V * RV) {
#if VALUES_F16
            // f16 pairs: [centroid][replica][SD_V/2 words]
#pragma unroll
            for (int dd = 0; dd < SD_V; dd += 2)
                ((unsigned int*)vb)[i * (SD_V / 2) + dd / 2] = pack_h2(vbook[(i / RV) * SD_V + dd], vbook[(i / RV) * SD_V + dd + 1]);
#elif SD_V % 4 == 0
#pragma unroll
            for (int dd = 0; dd < SD_V; dd += 4) *(float4*)(vb + i * SD_V + dd) = *(const float4*)(vbook + (i / RV) * SD_V + dd);
#else
#pragma unroll
            for (int dd = 0; dd < SD_V; dd++) vb[i * SD_V + dd] = vbook[(i / RV) * SD_V + dd];
#endif
        }
    }
#pragma unroll
    for (int k = 0; k < (K_K * SD_K / 2 + THREADS - 1) / THREADS; k++) {
        const int i = tid + k * THREADS;
        if (i < K_K * SD_K / 2) ((float2*)kb)[i] = ((const float2*)kbook)[i];
    }

    // The first key codes of this thread are requested now; they arrive while the table is built.
    const unsigned char* kc = kcodes + ((size_t)(cs * HKV + h) * stride) * M_K;
    constexpr int NW = M_K / 4, A = M_K / PJ;
    auto load_codes = [&](unsigned int (&w)[NW], int t) {
        const unsigned char* row = kc + (size_t)(t0 + t) * M_K;
#if M_K % 16 == 0
#pragma unroll
        for (int k = 0; k < NW / 4; k++) {
            const uint4 u = ((const uint4*)row)[k];
            w[4 * k] = u.x; w[4 * k + 1] = u.y; w[4 * k + 2] = u.z; w[4 * k + 3] = u.w;
        }
#else
#pragma unroll
        for (int k = 0; k < NW; k++) w[k] = ((const unsigned int*)row)[k];
#endif
    };
    unsigned int wnext[NW];
    if (tid < n) load_codes(wnext, tid);
    for (int g = warp; g < GB; g += nwarps) {
        float v[D / 32];
        float off = 0.f;
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int e = i * 32 + lane;
            float f = q[((size_t)qb * HQ + qh0 + g) * D + e] * scale;
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
    // Entry i of the table is (jq, c, jr) = (i / (K_K·PJ), i / PJ mod K_K, i mod PJ): consecutive
    // threads write consecutive entries.
    for (int i = tid; i < M_K * K_K; i += THREADS) {
        const int jr = i % PJ, c = (i / PJ) % K_K, j = (i / (PJ * K_K)) * PJ + jr;
        float e[GBP];
#pragma unroll
        for (int g = 0; g < GBP; g++) e[g] = (g < GB && j == 0) ? red[g * 32 + 31] : 0.f;
#if SD_K % 4 == 0
#pragma unroll
        for (int d = 0; d < SD_K; d += 4) {
            const float4 kv = *(const float4*)(kb + c * SD_K + d);
#pragma unroll
            for (int g = 0; g < GB; g++) {
                const float4 qv = *(const float4*)(qt + g * D + j * SD_K + d);
                e[g] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, e[g]))));
            }
        }
#else
#pragma unroll
        for (int d = 0; d < SD_K; d += 2) {
            const float2 kv = *(const float2*)(kb + c * SD_K + d);
#pragma unroll
            for (int g = 0; g < GB; g++) {
                const float2 qv = *(const float2*)(qt + g * D + j * SD_K + d);
                e[g] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, e[g]));
            }
        }
#endif
#if GBP == 4
        *(float4*)(lut + i * 4) = make_float4(e[0], e[1], e[2], e[3]);
#elif GBP == 2
        *(float2*)(lut + i * 2) = make_float2(e[0], e[1]);
#else
        lut[i] = e[0];
#endif
    }
    __syncthreads();

    // Pass 1: scores, key codes read once per token for all GB heads. The lane's code bytes are
    // rotated by r = lane mod PJ so that step i reads sub-space j = (i + r) mod M_K.
    const int r = lane % PJ;
    int boff[PJ], bwrap[PJ];  // float offset of sub-space a·PJ + b + r past block a (wrapping in the last)
#pragma unroll
    for (int bb = 0; bb < PJ; bb++) {
        const int x = bb + r, carry = x >= PJ;
        boff[bb] = ((carry ? K_K * PJ : 0) + x - (carry ? PJ : 0)) * GBP;
        bwrap[bb] = boff[bb] - (carry ? M_K * K_K * GBP : 0);
    }
    float mx[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) mx[g] = -3.402823466e38f;
    for (int t = tid; t < n; t += THREADS) {
        unsigned int w[NW];
#pragma unroll
        for (int k = 0; k < NW; k++) w[k] = wnext[k];
        if (t + THREADS < n) load_codes(wnext, t + THREADS);
        // Rotate the byte string left by r: words by r / 4, then bytes by r mod 4.
#pragma unroll
        for (int bit = 1; bit < PJ / 4; bit <<= 1) {
            unsigned int tmp[NW];
#pragma unroll
            for (int k = 0; k < NW; k++) tmp[k] = ((r >> 2) & bit) ? w[(k + bit) % NW] : w[k];
#pragma unroll
            for (int k = 0; k < NW; k++) w[k] = tmp[k];
        }
        {
            const unsigned int sh = (r & 3) * 8;
            const unsigned int w0 = w[0];
#pragma unroll
            for (int k = 0; k < NW; k++) w[k] = __funnelshift_r(w[k], k + 1 < NW ? w[k + 1] : w0, sh);
        }
        float s[GB];
#pragma unroll
        for (int g = 0; g < GB; g++) s[g] = 0.f;
#pragma unroll
        for (int a = 0; a < A; a++) {
#pragma unroll
            for (int bb = 0; bb < PJ; bb++) {
                const int i = a * PJ + bb;
                const int code = (w[i >> 2] >> (8 * (i & 3))) & 0xff;
                add_entry(s, lut + code * (PJ * GBP) + a * (K_K * PJ * GBP) + (a == A - 1 ? bwrap[bb] : boff[bb]));
            }
        }
#if GBP == 4
        float4 o;
        o.x = s[0];
        o.y = GB > 1 ? s[GB > 1 ? 1 : 0] : 0.f;
        o.z = GB > 2 ? s[GB > 2 ? 2 : 0] : 0.f;
        o.w = GB > 3 ? s[GB > 3 ? 3 : 0] : 0.f;
        *(float4*)(p + t * 4) = o;
#else
#pragma unroll
        for (int g = 0; g < GB; g++) p[t * GBP + g] = s[g];
#endif
#pragma unroll
        for (int g = 0; g < GB; g++) mx[g] = fmaxf(mx[g], s[g]);
    }
    // Pass 2: block maxima and sums per head, weights in place. The first chunk of value codes is
    // loaded into registers meanwhile (the table is no longer read).
    __syncthreads();
    const unsigned char* vc = vcodes + ((size_t)(cs * HKV + h) * stride) * M_V;
    unsigned char* vs = (unsigned char*)lut;  // [CHUNK][M_V], in the table space
    int c0s = 0;  // first token of the chunk being staged
#if M_V % 16 == 0
    constexpr int VPER = (CHUNK * M_V / 16 + THREADS - 1) / THREADS;
    uint4 pre[VPER];
    auto load_chunk = [&](int c0, int cn) {
        const uint4* src = (const uint4*)(vc + (size_t)(t0 + c0) * M_V);
#pragma unroll
        for (int k = 0; k < VPER; k++) {
            const int i = tid + k * THREADS;
            if (i < cn * M_V / 16) pre[k] = src[i];
        }
    };
    auto store_chunk = [&](int cn) {
#pragma unroll
        for (int k = 0; k < VPER; k++) {
            const int i = tid + k * THREADS;
            if (i < cn * M_V / 16) ((uint4*)vs)[i] = pre[k];
        }
    };
#else
    auto load_chunk = [&](int, int) {};
    auto store_chunk = [&](int cn) {
        for (int i = tid; i < cn * M_V; i += THREADS) vs[i] = vc[(size_t)(t0 + c0s) * M_V + i];
    };
#endif
    load_chunk(0, min(CHUNK, n));
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
#if GBP == 4
        float4 v = *(float4*)(p + t * 4);
        float* e = (float*)&v;
#else
        float* e = p + t * GBP;
#endif
#pragma unroll
        for (int g = 0; g < GB; g++) {
            e[g] = __expf(e[g] - mx[g]);
            sum[g] += e[g];
        }
#if VALUES_F16
        // Each head's weight as an f16 pair (w, w), in place of its f32.
#pragma unroll
        for (int g = 0; g < GB; g++) ((unsigned int*)p)[t * GBP + g] = pack_h2(e[g], e[g]);
#elif GBP == 4
        *(float4*)(p + t * 4) = v;
#endif
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
    constexpr int LPT = M_V < 32 ? M_V : 32;  // lanes per token
    constexpr int TPW = 32 / LPT;             // tokens per warp step
    constexpr int JPL = M_V / LPT;            // sub-spaces per lane
    constexpr int SLOTS = (THREADS / 32) * TPW;
    const int slot = warp * TPW + lane / LPT, jl = lane % LPT;
    float acc[GB][JPL][SD_V];
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int jj = 0; jj < JPL; jj++)
#pragma unroll
            for (int dd = 0; dd < SD_V; dd++) acc[g][jj][dd] = 0.f;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int cn = min(CHUNK, n - c0);
        c0s = c0;
        if (c0 > 0) load_chunk(c0, cn);
        __syncthreads();
        store_chunk(cn);
        __syncthreads();
#if VALUES_F16
        // Packed f16 FMAs (half the instructions), partial sums of FL tokens flushed to f32.
        constexpr int FL = 8;
        const unsigned int* vbw = (const unsigned int*)vb;
        const unsigned int* pw2s = (const unsigned int*)p;
        for (int tb = slot; tb < cn; tb += SLOTS * FL) {
            unsigned int hacc[GB][JPL][SD_V / 2];
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int jj = 0; jj < JPL; jj++)
#pragma unroll
                    for (int k = 0; k < SD_V / 2; k++) hacc[g][jj][k] = 0u;
#pragma unroll
            for (int f = 0; f < FL; f++) {
                const int t = tb + f * SLOTS;
                if (t < cn) {
                    unsigned int pw[GB];
#pragma unroll
                    for (int g = 0; g < GB; g++) pw[g] = pw2s[(c0 + t) * GBP + g];
#pragma unroll
                    for (int jj = 0; jj < JPL; jj++) {
                        const int code = vs[t * M_V + jl + jj * LPT];
                        const unsigned int* cr = vbw + (code * RV + (jl + jj * LPT) % RV) * (SD_V / 2);
                        unsigned int cw[SD_V / 2];
#if SD_V == 4
                        const uint2 u = *(const uint2*)cr;
                        cw[0] = u.x; cw[1] = u.y;
#else
#pragma unroll
                        for (int k = 0; k < SD_V / 2; k++) cw[k] = cr[k];
#endif
#pragma unroll
                        for (int g = 0; g < GB; g++)
#pragma unroll
                            for (int k = 0; k < SD_V / 2; k++) hacc[g][jj][k] = hfma2(pw[g], cw[k], hacc[g][jj][k]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GB; g++)
#pragma unroll
                for (int jj = 0; jj < JPL; jj++)
#pragma unroll
                    for (int k = 0; k < SD_V / 2; k++) {
                        const float2 f = unpack_h2(hacc[g][jj][k]);
                        acc[g][jj][2 * k] += f.x;
                        acc[g][jj][2 * k + 1] += f.y;
                    }
        }
#else
#pragma unroll 4
        for (int t = slot; t < cn; t += SLOTS) {
            float pw[GB];
#if GBP == 4
            const float4 pv = *(const float4*)(p + (c0 + t) * 4);
            pw[0] = pv.x;
            if (GB > 1) pw[GB > 1 ? 1 : 0] = pv.y;
            if (GB > 2) pw[GB > 2 ? 2 : 0] = pv.z;
            if (GB > 3) pw[GB > 3 ? 3 : 0] = pv.w;
#else
#pragma unroll
            for (int g = 0; g < GB; g++) pw[g] = p[(c0 + t) * GBP + g];
#endif
#pragma unroll
            for (int jj = 0; jj < JPL; jj++) {
                const int code = vs[t * M_V + jl + jj * LPT];
                const float* cr = vb + (code * RV + (jl + jj * LPT) % RV) * SD_V;
                float c[SD_V];
#if SD_V % 4 == 0
#pragma unroll
                for (int dd = 0; dd < SD_V; dd += 4) {
                    const float4 cv = *(const float4*)(cr + dd);
                    c[dd] = cv.x; c[dd + 1] = cv.y; c[dd + 2] = cv.z; c[dd + 3] = cv.w;
                }
#elif SD_V == 2
                const float2 cv = *(const float2*)cr;
                c[0] = cv.x; c[1] = cv.y;
#else
#pragma unroll
                for (int dd = 0; dd < SD_V; dd++) c[dd] = cr[dd];
#endif
#pragma unroll
                for (int g = 0; g < GB; g++)
#pragma unroll
                    for (int dd = 0; dd < SD_V; dd++) acc[g][jj][dd] = fmaf(pw[g], c[dd], acc[g][jj][dd]);
            }
        }
#endif
    }
    __syncthreads();
    float* obuf = lut;  // slot partials [SLOTS][GB][D]
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
        for (int jj = 0; jj < JPL; jj++)
#pragma unroll
            for (int dd = 0; dd < SD_V; dd++) obuf[(slot * GB + g) * D + (jl + jj * LPT) * SD_V + dd] = acc[g][jj][dd];
    if (tid == 0) {
#pragma unroll
        for (int g = 0; g < GB; g++) {
            red[g * 32] = n > 0 ? mx[g] : -3.402823466e38f;
            red[g * 32 + 1] = n > 0 ? sum[g] : 0.f;
        }
    }
    __syncthreads();
    for (int i = tid; i < GB * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float o = 0.f;
        for (int sl = 0; sl < SLOTS; sl++) o += obuf[(sl * GB + g) * D + d];
        const size_t part = (size_t)(b * HQ + qh0 + g) * nsplit + sp;
        part_o[part * D + d] = o;
        if (d < 2) part_ml[part * 2 + d] = red[g * 32 + d];
    }
}
