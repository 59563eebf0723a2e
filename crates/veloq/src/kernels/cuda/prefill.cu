// Attention of a block of queries over one sequence's stored positions (chunked prefill, follow-up
// turns), flash-style on tensor cores, in two flavours sharing one body: over VecInfer codes
// (keys and values never leave code space) and over f16 rows (the fp16 cache, causal mask). A
// block takes one kv head, QPB queries × its G query heads (ROWS = 16 per warp) and one split of
// the positions; per tile of TP positions it stages keys [position][dim] and values transposed
// [dim][position] as f16 in shared memory (decoding codes to centroids, or copying rows), then each
// warp computes S = Q·Kᵀ for its 16 rows (mma), folds S into its online softmax in registers, and
// accumulates O += P·V (mma, P reused from S's accumulators as the A fragments). Nothing is ever
// larger than a tile. Output: per split, row (head, query) the unnormalised O, the maximum score
// and the sum of weights; the host merges splits (and maps coded O back to value space).
//
// q: [Hq][t][D] f32, scaled (codes: also smoothed and rotated into code space). Codes: kc/vc at
// the sequence's first stream, stream h's position p at (h·stride + p)·M; books f16 [256][SD].
// Rows: kr/vr at the span's first row of stream 0, stream h's row p at (h·stride + p)·D; row p
// holds position pos0 + p, query i position qpos0 + i, and a query sees positions ≤ its own.
//
// Defines: D, G, SDK, SDV, WARPS, TP.

#define ROWS (WARPS * 16)
#define QPB (ROWS / G)
#define MK (D / SDK)
#define MV (D / SDV)
#define QS (D + 8)  // row strides in halves, padded so that a fragment load hits 32 distinct banks
#define KS (D + 8)
#define VS (TP + 8)

#if TP % 16 != 0 || D % 16 != 0 || G > ROWS || SDK % 2 != 0 || SDV % 2 != 0 || (TP * (D / SDK)) % 16 != 0 || (TP * (D / SDV)) % 16 != 0
#error "vq_prefill_codes: TP and D multiples of 16, G ≤ ROWS, even sub_dims"
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

#define THREADS (WARPS * 32)
// Three blocks per multiprocessor where shared memory allows (D ≤ 128): registers capped to fit.
#define MIN_BLOCKS (D <= 128 ? 3 : 1)
#define KQ ((TP * MK / 16 + THREADS - 1) / THREADS)
#define VQ ((TP * MV / 16 + THREADS - 1) / THREADS)

// 16 code bytes of a tile (positions p0.. of M bytes each) from word `w`: one read-only load that
// skips L1 when the tile is whole and aligned, else byte by byte with positions past `end` as 0.
template <int M>
__device__ __forceinline__ uint4 code_word(const unsigned char* __restrict__ codes, int p0, int end, int w, bool vec) {
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (w >= TP * M / 16) return x;
    const unsigned char* src = codes + (size_t)p0 * M + w * 16;
    if (vec && p0 + TP <= end) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "l"(src));
        return x;
    }
    unsigned b[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; i++) {
        if (p0 + (w * 16 + i) / M < end) b[i / 4] |= (unsigned)src[i] << (8 * (i % 4));
    }
    return make_uint4(b[0], b[1], b[2], b[3]);
}

__device__ __forceinline__ void fetch_codes(uint4 (&kq)[KQ], uint4 (&vq)[VQ], const unsigned char* __restrict__ kcs,
                                            const unsigned char* __restrict__ vcs, int p0, int end, bool vec,
                                            int tid) {
#pragma unroll
    for (int i = 0; i < KQ; i++) kq[i] = code_word<MK>(kcs, p0, end, tid + i * THREADS, vec);
#pragma unroll
    for (int i = 0; i < VQ; i++) vq[i] = code_word<MV>(vcs, p0, end, tid + i * THREADS, vec);
}

__device__ __forceinline__ unsigned byte_of(const uint4& x, int i) {
    const unsigned w = i < 4 ? x.x : i < 8 ? x.y : i < 12 ? x.z : x.w;
    return (w >> (8 * (i % 4))) & 0xffu;
}

// Decodes fetched codes into the tile's keys [position][dim] and values [dim][position] (f16
// centroids from the shared books). Positions past the end got code 0; the mask drops them.
__device__ __forceinline__ void stage_codes(const uint4 (&kq)[KQ], const uint4 (&vq)[VQ],
                                            const unsigned short* kb, const unsigned short* vb, unsigned short* Ks,
                                            unsigned short* Vt, int tid) {
#pragma unroll
    for (int i = 0; i < KQ; i++) {
        const int w = tid + i * THREADS;
        if (w >= TP * MK / 16) break;
#pragma unroll
        for (int b = 0; b < 16; b++) {
            const int at = w * 16 + b, pos = at / MK, j = at % MK;
            const unsigned* c = (const unsigned*)(kb + byte_of(kq[i], b) * SDK);
            unsigned* dst = (unsigned*)(Ks + pos * KS + j * SDK);
#pragma unroll
            for (int e = 0; e < SDK / 2; e++) dst[e] = c[e];
        }
    }
#pragma unroll
    for (int i = 0; i < VQ; i++) {
        const int w = tid + i * THREADS;
        if (w >= TP * MV / 16) break;
#pragma unroll
        for (int b = 0; b < 16; b++) {
            const int at = w * 16 + b, pos = at / MV, j = at % MV;
            const unsigned short* c = vb + byte_of(vq[i], b) * SDV;
#pragma unroll
            for (int e = 0; e < SDV; e++) Vt[(j * SDV + e) * VS + pos] = c[e];
        }
    }
}

template <bool CODES>
__device__ __forceinline__ void prefill_body(const float* __restrict__ q, int t, const void* __restrict__ ksrc,
                                             const void* __restrict__ vsrc, int len, int stride, int pos0, int qpos0,
                                             const unsigned short* __restrict__ kbook,
                                             const unsigned short* __restrict__ vbook, int per_split,
                                             float* __restrict__ out_o, float* __restrict__ out_ml) {
    extern __shared__ unsigned short smem[];
    unsigned short* Qs = smem;            // [ROWS][QS]
    unsigned short* Ks = Qs + ROWS * QS;  // [TP][KS]
    unsigned short* Vt = Ks + TP * KS;    // [D][VS]
    unsigned short* kb = Vt + D * VS;     // [256][SDK]
    unsigned short* vb = kb + 256 * SDK;  // [256][SDV]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, split = blockIdx.z, hq_total = gridDim.y * G;
    const int q0 = blockIdx.x * QPB;
    const int p_begin = split * per_split;
    // Rows after the block's last query are masked for all its queries: stop before them.
    const int p_end = min(min(len, p_begin + per_split), qpos0 + min(t, q0 + QPB) - pos0);

    if (CODES) {
        for (int i = tid; i < 256 * SDK / 2; i += blockDim.x) ((unsigned*)kb)[i] = ((const unsigned*)kbook)[i];
        for (int i = tid; i < 256 * SDV / 2; i += blockDim.x) ((unsigned*)vb)[i] = ((const unsigned*)vbook)[i];
    }
    // Row r: query q0 + r / G of query head h·G + r % G; rows past the block's queries are zero.
    for (int i = tid; i < ROWS * D; i += blockDim.x) {
        const int r = i / D, e = i % D, qi = q0 + r / G;
        float x = 0.f;
        if (r < QPB * G && qi < t) x = q[((size_t)(h * G + r % G) * t + qi) * D + e];
        Qs[r * QS + e] = f2h(x);
    }

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    // This lane's two rows (g and g + 8 of the warp's 16): running maximum and (lane-partial) sum.
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;
    const unsigned short* Qw = Qs + warp * 16 * QS;
    const unsigned char* kcs = (const unsigned char*)ksrc + (size_t)h * stride * MK;
    const unsigned char* vcs = (const unsigned char*)vsrc + (size_t)h * stride * MV;
    const unsigned short* krs = (const unsigned short*)ksrc + (size_t)h * stride * D;
    const unsigned short* vrs = (const unsigned short*)vsrc + (size_t)h * stride * D;
    // The positions of this lane's two rows' queries (rows past the block's queries see all).
    const int qp0 = qpos0 + q0 + (warp * 16 + g) / G, qp1 = qpos0 + q0 + (warp * 16 + g + 8) / G;

    // This thread's share of a tile's codes (KQ and VQ 16-byte words), fetched a tile ahead.
    uint4 kq[KQ], vq[VQ];
    const bool vec = (((size_t)kcs | (size_t)vcs) & 15) == 0;
    if (CODES && p_begin < p_end) fetch_codes(kq, vq, kcs, vcs, p_begin, p_end, vec, tid);

    for (int p0 = p_begin; p0 < p_end; p0 += TP) {
        const int n = min(TP, p_end - p0);
        __syncthreads();  // the previous tile is read (the first time: queries and books written)
        if (CODES) {
            // The tile's codes came into registers during the previous tile's products.
            stage_codes(kq, vq, kb, vb, Ks, Vt, tid);
            if (p0 + TP < p_end) fetch_codes(kq, vq, kcs, vcs, p0 + TP, p_end, vec, tid);
        } else {
            for (int i = tid; i < TP * D / 2; i += blockDim.x) {
                const int pos = i / (D / 2), w = i % (D / 2);
                const unsigned x = pos < n ? ((const unsigned*)(krs + (size_t)(p0 + pos) * D))[w] : 0u;
                ((unsigned*)(Ks + pos * KS))[w] = x;
            }
            for (int i = tid; i < TP * D / 2; i += blockDim.x) {
                const int pos = i / (D / 2), w = i % (D / 2);
                const unsigned x = pos < n ? ((const unsigned*)(vrs + (size_t)(p0 + pos) * D))[w] : 0u;
                Vt[(2 * w) * VS + pos] = (unsigned short)(x & 0xffffu);
                Vt[(2 * w + 1) * VS + pos] = (unsigned short)(x >> 16);
            }
        }
        __syncthreads();

        float s[TP / 8][4];
#pragma unroll
        for (int nt = 0; nt < TP / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const unsigned short* qa = Qw + g * QS + kk * 16 + 2 * tq;
            const unsigned a0 = *(const unsigned*)qa, a1 = *(const unsigned*)(qa + 8 * QS);
            const unsigned a2 = *(const unsigned*)(qa + 8), a3 = *(const unsigned*)(qa + 8 * QS + 8);
#pragma unroll
            for (int nt = 0; nt < TP / 8; nt++) {
                const unsigned short* kr = Ks + (nt * 8 + g) * KS + kk * 16 + 2 * tq;
                mma_16816(s[nt], a0, a1, a2, a3, *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }

        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < TP / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = nt * 8 + 2 * tq + e, at = pos0 + p0 + p;
                if (p >= n || at > qp0) s[nt][e] = neg_inf();
                if (p >= n || at > qp1) s[nt][2 + e] = neg_inf();
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        const float al0 = __expf(m0 - mx0), al1 = __expf(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= al0;
        l1 *= al1;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            o[nd][0] *= al0;
            o[nd][1] *= al0;
            o[nd][2] *= al1;
            o[nd][3] *= al1;
        }
#pragma unroll
        for (int nt = 0; nt < TP / 8; nt++) {
            s[nt][0] = __expf(s[nt][0] - m0);
            s[nt][1] = __expf(s[nt][1] - m0);
            s[nt][2] = __expf(s[nt][2] - m1);
            s[nt][3] = __expf(s[nt][3] - m1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }

        // S's accumulators of position tiles 2kk and 2kk+1 are P's A fragment for k-step kk.
#pragma unroll
        for (int kk = 0; kk < TP / 16; kk++) {
            const unsigned pa0 = pack_h2(s[2 * kk][0], s[2 * kk][1]), pa1 = pack_h2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned pa2 = pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned pa3 = pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                const unsigned short* vr = Vt + (nd * 8 + g) * VS + kk * 16 + 2 * tq;
                mma_16816(o[nd], pa0, pa1, pa2, pa3, *(const unsigned*)vr, *(const unsigned*)(vr + 8));
            }
        }
    }

    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = warp * 16 + g + 8 * half, qi = q0 + r / G;
        if (r >= QPB * G || qi >= t) continue;
        const size_t row = ((size_t)split * hq_total + h * G + r % G) * t + qi;
        float* dst = out_o + row * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            dst[nd * 8 + 2 * tq] = o[nd][2 * half];
            dst[nd * 8 + 2 * tq + 1] = o[nd][2 * half + 1];
        }
        if (tq == 0) {
            out_ml[row * 2] = half ? m1 : m0;
            out_ml[row * 2 + 1] = half ? l1 : l0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    vq_prefill_codes(const float* __restrict__ q, int t, const unsigned char* __restrict__ kc,
                     const unsigned char* __restrict__ vc, int len, int stride, const unsigned short* __restrict__ kbook,
                     const unsigned short* __restrict__ vbook, int per_split, float* __restrict__ out_o,
                     float* __restrict__ out_ml) {
    // Codes are older than every query: no mask.
    prefill_body<true>(q, t, kc, vc, len, stride, 0, 1 << 30, kbook, vbook, per_split, out_o, out_ml);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    f16_prefill_rows(const float* __restrict__ q, int t, const unsigned short* __restrict__ kr,
                     const unsigned short* __restrict__ vr, int len, int stride, int pos0, int qpos0, int per_split,
                     float* __restrict__ out_o, float* __restrict__ out_ml) {
    prefill_body<false>(q, t, kr, vr, len, stride, pos0, qpos0, nullptr, nullptr, per_split, out_o, out_ml);
}
