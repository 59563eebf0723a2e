// Attention of a tile of queries over one sequence's stored positions (chunked prefill, follow-up
// turns), flash-style on tensor cores, over f16 rows: any cache's sink, ring and the step's own
// rows (causal mask), and a VecInfer cache's codes decoded a block of positions at a time into f16
// rows of the cache's own space (vq_decode_rows: once per block for every query, not once per
// block of queries as a kernel decoding its own tiles would). A block takes one kv head, QPB
// queries × its G query heads (ROWS = 16 per warp) and one split of the positions; per tile of TP
// positions, keys and values [position][dim] land in shared memory by cp.async into a second
// buffer while the current tile is multiplied (no warp waits on global memory inside the loop);
// each warp computes S = Q·Kᵀ for its 16 rows (mma), folds S into its online softmax in
// registers, and accumulates O += P·V (mma; P reused from S's accumulators as the A fragments,
// V's B fragments read transposed by ldmatrix). Output per split, row (head, query): the
// unnormalised O, the maximum score and the sum of weights (or, with `accumulate`, those merged
// into what the split already holds: blocks of decoded codes share one set of partials);
// prefill_fold turns the splits of every launch of a tile into the output.
//
// q: [t][Hq][D] f32 (the step's packed queries from the tile's first), times qscale. A run's k/v
// at its first row of stream 0, stream h's row p at h·hs + p·rs (stored rows are head-major, a
// step's input rows token-major); row p holds position pos0 + p, query i position qpos0 + i, and a
// query sees positions ≤ its own (and, with a sliding window w > 0, the last w of them, itself
// included).
//
// Defines: D, G, SDK, SDV, WARPS, TP; for the codes' decode, CENTER_K, SMOOTH_K, ROTATE_K,
// CENTER_V, SMOOTH_V, ROTATE_V (0 where absent: rows only).
#ifndef CENTER_K
#define CENTER_K 0
#endif
#ifndef SMOOTH_K
#define SMOOTH_K 0
#endif
#ifndef ROTATE_K
#define ROTATE_K 0
#endif
#ifndef CENTER_V
#define CENTER_V 0
#endif
#ifndef SMOOTH_V
#define SMOOTH_V 0
#endif
#ifndef ROTATE_V
#define ROTATE_V 0
#endif

#define ROWS (WARPS * 16)
#define QPB (ROWS / G)
#define QS (D + 8)  // row strides in halves, padded so that a fragment load hits 32 distinct banks
#define KS (D + 8)

#if TP % 16 != 0 || D % 16 != 0 || G > ROWS || SDK % 2 != 0 || SDV % 2 != 0
#error "f16_prefill_rows: TP and D multiples of 16, G ≤ ROWS, even sub_dims"
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

#define THREADS (WARPS * 32)
// Four tiles (keys and values, double-buffered) fit two blocks per multiprocessor at D = 128:
// registers capped to fit.
#define ROW_BLOCKS (D <= 64 ? 3 : D <= 128 ? 2 : 1)

// One tile of f16 rows (positions p0.., n of them) into K and V buffers [position][dim]: 16-byte
// cp.async copies (zero-filled past n) when the rows are 16-byte aligned, else 4-byte copies.
// The caller commits the group (cp.async) and waits for it before the buffers are read.
__device__ __forceinline__ void load_rows(unsigned short* Kb, unsigned short* Vb, const unsigned short* __restrict__ krs,
                                          const unsigned short* __restrict__ vrs, int rs, int p0, int n, bool vec, int tid) {
    if (vec) {
        constexpr int CH = TP * D / 8, PER = (CH + THREADS - 1) / THREADS;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = tid + i * THREADS;
            if (c >= CH) break;
            const int pos = c / (D / 8), w = c % (D / 8);
            const size_t at = pos < n ? (size_t)(p0 + pos) * rs + w * 8 : 0;
            cp_async16(Kb + pos * KS + w * 8, krs + at, pos < n);
            cp_async16(Vb + pos * KS + w * 8, vrs + at, pos < n);
        }
        cp_async_commit();
        return;
    }
    for (int i = tid; i < TP * D / 2; i += THREADS) {
        const int pos = i / (D / 2), w = i % (D / 2);
        const bool in = pos < n;
        ((unsigned*)(Kb + pos * KS))[w] = in ? ((const unsigned*)(krs + (size_t)(p0 + pos) * rs))[w] : 0u;
        ((unsigned*)(Vb + pos * KS))[w] = in ? ((const unsigned*)(vrs + (size_t)(p0 + pos) * rs))[w] : 0u;
    }
}

// Four 8×8 f16 matrices transposed out of shared memory: this lane's address is row lane % 8 of
// matrix lane / 8.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Up to RUNS runs of rows in one launch (a sequence's sink, the two parts of its ring and the
// step's own rows): run r is split into splits[r] splits of per[r] positions, its partials at
// splits [Σ splits of the runs before r, + splits[r]) of the output. The grid's z is every
// split of every run.
#define RUNS 4
struct RowRuns {
    const unsigned short* k[RUNS];
    const unsigned short* v[RUNS];
    int len[RUNS], hs[RUNS], rs[RUNS], pos0[RUNS], per[RUNS], splits[RUNS];
    int n;
};

extern "C" __global__ void __launch_bounds__(WARPS * 32, ROW_BLOCKS)
    f16_prefill_rows(const float* __restrict__ q, float qscale, int t, const RowRuns runs, int qpos0, int window,
                     int accumulate, float* __restrict__ out_o, float* __restrict__ out_ml) {
    extern __shared__ unsigned short smem[];
    unsigned short* Qs = smem;            // [ROWS][QS]
    unsigned short* Ks = Qs + ROWS * QS;  // [4][TP][KS]: two buffers of keys, then two of values

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, part = blockIdx.z, hq_total = gridDim.y * G;
    // This block's run: selected field by field with constant indices (a dynamic index into the
    // parameter would copy it to local memory).
    const unsigned short *kr = runs.k[0], *vr = runs.v[0];
    int len = runs.len[0], hs = runs.hs[0], rs = runs.rs[0], pos0 = runs.pos0[0], per_split = runs.per[0];
    int split = part;
#pragma unroll
    for (int r = 1, first = runs.splits[0]; r < RUNS; first += runs.splits[r], r++) {
        if (r < runs.n && part >= first) {
            kr = runs.k[r];
            vr = runs.v[r];
            len = runs.len[r];
            hs = runs.hs[r];
            rs = runs.rs[r];
            pos0 = runs.pos0[r];
            per_split = runs.per[r];
            split = part - first;
        }
    }
    const int q0 = blockIdx.x * QPB;
    // Rows after the block's last query are masked for all its queries: stop before them; with a
    // sliding window, whole tiles before the first query's window are skipped (tiles stay aligned
    // to the split's start).
    const int p_split = split * per_split;
    const int p_end = min(min(len, p_split + per_split), qpos0 + min(t, q0 + QPB) - pos0);
    const int lo = window > 0 ? qpos0 + q0 - (window - 1) - pos0 : 0;
    const int p_begin = lo > p_split ? p_split + (lo - p_split) / TP * TP : p_split;

    // Row r: query q0 + r / G of query head h·G + r % G; rows past the block's queries are zero.
    // Every load of a batch is requested before the first store (a loop of load → store waited
    // one global round trip per element: 64 of them, most of a short run's time).
    {
        constexpr int V4 = ROWS * D / 4, PER = (V4 + THREADS - 1) / THREADS, BATCH = PER < 8 ? PER : 8;
        // Float4 c (the k-th of batch b0) is in the tile; the bound on c is needed only where the
        // tile is not whole float4s per thread (written so that it compiles away elsewhere).
        const auto in_tile = [&](int b0, int k, int c) { return b0 + k < PER && (V4 % THREADS == 0 || c < V4); };
#pragma unroll
        for (int b0 = 0; b0 < PER; b0 += BATCH) {
            float4 x[BATCH];
#pragma unroll
            for (int k = 0; k < BATCH; k++) {
                const int c = tid + (b0 + k) * THREADS, r = c / (D / 4), qi = q0 + r / G;
                x[k] = in_tile(b0, k, c) && r < QPB * G && qi < t
                           ? *(const float4*)(q + ((size_t)qi * hq_total + h * G + r % G) * D + c % (D / 4) * 4)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < BATCH; k++) {
                const int c = tid + (b0 + k) * THREADS, r = c / (D / 4);
                if (!in_tile(b0, k, c)) continue;
                *(uint2*)(Qs + r * QS + c % (D / 4) * 4) =
                    make_uint2(pack_h2(x[k].x * qscale, x[k].y * qscale), pack_h2(x[k].z * qscale, x[k].w * qscale));
            }
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    // This lane's two rows (g and g + 8 of the warp's 16): running maximum and (lane-partial) sum.
    float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;
    const unsigned short* Qw = Qs + warp * 16 * QS;
    const unsigned short* krs = kr + (size_t)h * hs;
    const unsigned short* vrs = vr + (size_t)h * hs;
    // The positions of this lane's two rows' queries (rows past the block's queries see all).
    const int qp0 = qpos0 + q0 + (warp * 16 + g) / G, qp1 = qpos0 + q0 + (warp * 16 + g + 8) / G;

    const bool vec = (((size_t)krs | (size_t)vrs | (size_t)(rs * 2)) & 15) == 0;
    if (p_begin < p_end) load_rows(Ks, Ks + 2 * TP * KS, krs, vrs, rs, p_begin, min(TP, p_end - p_begin), vec, tid);

    for (int p0 = p_begin, buf = 0; p0 < p_end; p0 += TP, buf ^= 1) {
        const int n = min(TP, p_end - p0);
        __syncthreads();  // the previous tile is read (the first time: queries written)
        // This tile's keys and values [position][dim].
        const unsigned short* Kt = Ks + buf * TP * KS;
        const unsigned short* Vr = Ks + (2 + buf) * TP * KS;
        if (p0 + TP < p_end) {
            // The next tile lands in the other buffers while this one is multiplied.
            load_rows(Ks + (buf ^ 1) * TP * KS, Ks + (3 - buf) * TP * KS, krs, vrs, rs, p0 + TP,
                      min(TP, p_end - p0 - TP), vec, tid);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
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
                const unsigned short* kr = Kt + (nt * 8 + g) * KS + kk * 16 + 2 * tq;
                mma_16816(s[nt], a0, a1, a2, a3, *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }

        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < TP / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = nt * 8 + 2 * tq + e, at = pos0 + p0 + p;
                if (p >= n || at > qp0 || (window > 0 && qp0 - at >= window)) s[nt][e] = neg_inf();
                if (p >= n || at > qp1 || (window > 0 && qp1 - at >= window)) s[nt][2 + e] = neg_inf();
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
            // Matrices: positions 0–7 and 8–15 of the k-step × dims of tiles nd and nd + 1.
            const unsigned short* vr = Vr + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + (lane >> 4) * 8;
#pragma unroll
            for (int nd = 0; nd < D / 8; nd += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, vr + nd * 8);
                mma_16816(o[nd], pa0, pa1, pa2, pa3, b[0], b[1]);
                mma_16816(o[nd + 1], pa0, pa1, pa2, pa3, b[2], b[3]);
            }
        }
    }

    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    // With `accumulate`, the split's earlier partial (an earlier block of decoded codes) is
    // merged in: read by every lane of the row before any lane writes.
    float om[2] = {-1e30f, -1e30f}, ol[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = warp * 16 + g + 8 * half, qi = q0 + r / G;
        if (!accumulate || r >= QPB * G || qi >= t) continue;
        const size_t row = ((size_t)part * hq_total + h * G + r % G) * t + qi;
        om[half] = out_ml[row * 2];
        ol[half] = out_ml[row * 2 + 1];
    }
    __syncwarp();
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = warp * 16 + g + 8 * half, qi = q0 + r / G;
        if (r >= QPB * G || qi >= t) continue;
        const size_t row = ((size_t)part * hq_total + h * G + r % G) * t + qi;
        float* dst = out_o + row * D;
        float mm = half ? m1 : m0, ll = half ? l1 : l0, a = 0.f, b = 1.f;
        if (accumulate) {
            const float mx = fmaxf(om[half], mm);
            a = __expf(om[half] - mx);
            b = __expf(mm - mx);
            mm = mx;
            ll = fmaf(ol[half], a, ll * b);
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            const int e = nd * 8 + 2 * tq;
            dst[e] = accumulate ? fmaf(dst[e], a, o[nd][2 * half] * b) : o[nd][2 * half];
            dst[e + 1] = accumulate ? fmaf(dst[e + 1], a, o[nd][2 * half + 1] * b) : o[nd][2 * half + 1];
        }
        if (tq == 0) {
            out_ml[row * 2] = mm;
            out_ml[row * 2 + 1] = ll;
        }
    }
}

// Codes of positions p0..p0 + n of a sequence into f16 rows of the cache's own space — what an f16
// row of the position would hold, up to the code's error: x = μ + s ⊙ H·c for the row's centroids
// c, as the CPU decoder maps them back — so that the codes are one more run of rows for
// f16_prefill_rows (the queries, the launch and the fold are the rows'). Each lane holds 8
// consecutive elements of a row (one load of its code bytes, one 16-byte store), D / 8 lanes a
// row and 32 / (D / 8) rows a warp; the rotation is three stages in registers and the rest by
// shuffles among the row's lanes. Books staged in shared memory; codes [HKV][stride][M] (position
// p of stream h at (h·stride + p)·M), books f16 [256][SD], mean and scale [HKV][D] (read where
// the codec has them). With `Around`, the sequence's f16 rows of the positions just before and
// after the codes (its sink, its ring's one or two parts) are copied around them, so that the
// sink, the codes and the ring are one run of consecutive positions: out [HKV][T][D] (stream h's
// row r at (h·T + r)·D), T = sink + n + ring rows; row r < sink is sink row r, the next n the
// codes, the rest the ring parts in order. The host keeps HKV·T < 2^31.
#define DL (D / 8)
#define RPW (32 / DL)
struct Around {
    const unsigned short* k;  // the slot's stored key rows, stream h's row r at h·hs + r·D
    const unsigned short* v;
    int hs, sink, r0, n0, r1, n1;
};

template <int SD, bool CENTER, bool SMOOTH, bool ROTATE>
__device__ __forceinline__ void decode_rows(const unsigned char* __restrict__ codes, int heads, int stride, int p0,
                                            int n, const unsigned short* book, const float* __restrict__ mean,
                                            const float* __restrict__ scale, const unsigned short* __restrict__ rows_in,
                                            const Around& ar, unsigned short* __restrict__ out) {
    constexpr int M = D / SD;
    const int lane = threadIdx.x % 32, sub = lane % DL, slot = lane / DL, e0 = sub * 8;
    const int total = ar.sink + n + ar.n0 + ar.n1;
    const int warps = blockDim.x / 32, rows = heads * total, groups = (rows + RPW - 1) / RPW;
    // A warp's groups of rows are consecutive, so that its rows share a head and the head's
    // scale and mean stay in registers.
    const int all = gridDim.x * warps, per = (groups + all - 1) / all;
    const int g0 = (blockIdx.x * warps + threadIdx.x / 32) * per, g1 = min(groups, g0 + per);
    int hc = -1;
    float sc[8], mu[8];
    for (int grp = g0; grp < g1; grp++) {
        // Lanes past the last row (or past RPW·DL), and lanes copying a row, decode a row they
        // do not store: every lane of the warp takes part in the shuffles.
        const int row = min(grp * RPW + slot, rows - 1), r = row % total, h = row / total;
        const bool store = slot < RPW && grp * RPW + slot < rows;
        const int p = min(max(r - ar.sink, 0), n - 1);
        const unsigned char* code = codes + ((size_t)h * stride + p0 + p) * M;
        float v[8];
        if constexpr (SD >= 8) {
            const uint4 w = *(const uint4*)(book + code[e0 / SD] * SD + e0 % SD);
            const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = unpack_h2(ws[k]);
                v[2 * k] = f.x;
                v[2 * k + 1] = f.y;
            }
        } else {
            constexpr int C = 8 / SD;  // codes a lane reads
            unsigned c4;
            if constexpr (C == 4) c4 = *(const unsigned*)(code + e0 / SD);
            else if constexpr (C == 2) c4 = *(const unsigned short*)(code + e0 / SD);
            else c4 = code[e0 / SD];
#pragma unroll
            for (int j = 0; j < C; j++) {
                const unsigned short* cen = book + ((c4 >> (8 * j)) & 255u) * SD;
#pragma unroll
                for (int k = 0; k < SD / 2; k++) {
                    const float2 f = unpack_h2(((const unsigned*)cen)[k]);
                    v[j * SD + 2 * k] = f.x;
                    v[j * SD + 2 * k + 1] = f.y;
                }
            }
        }
        if constexpr (ROTATE) {
#pragma unroll
            for (int hb = 1; hb < 8; hb <<= 1) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if ((i & hb) == 0) {
                        const float a = v[i], b = v[i | hb];
                        v[i] = a + b;
                        v[i | hb] = a - b;
                    }
                }
            }
#pragma unroll
            for (int m = 1; m < DL; m <<= 1) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float o = __shfl_xor_sync(FULL_MASK, v[i], m);
                    v[i] = (sub & m) ? (o - v[i]) : (v[i] + o);
                }
            }
            const float norm = rsqrtf((float)D);
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] *= norm;
        }
        if (!store) continue;
        if (r < ar.sink || r >= ar.sink + n) {
            const int j = r - ar.sink - n, from = r < ar.sink ? r : j < ar.n0 ? ar.r0 + j : ar.r1 + j - ar.n0;
            const unsigned short* src = rows_in + (size_t)h * ar.hs + (size_t)from * D + e0;
            *(uint4*)(out + (size_t)row * D + e0) = *(const uint4*)src;
            continue;
        }
        if (h != hc) {
            // Two 16-byte loads each (e0 is a multiple of 8 floats).
            hc = h;
#pragma unroll
            for (int i = 0; i < 8; i += 4) {
                const float4 s4 = SMOOTH ? *(const float4*)(scale + h * D + e0 + i) : make_float4(1.f, 1.f, 1.f, 1.f);
                const float4 m4 = CENTER ? *(const float4*)(mean + h * D + e0 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
                sc[i] = s4.x, sc[i + 1] = s4.y, sc[i + 2] = s4.z, sc[i + 3] = s4.w;
                mu[i] = m4.x, mu[i + 1] = m4.y, mu[i + 2] = m4.z, mu[i + 3] = m4.w;
            }
        }
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a = v[2 * k], b = v[2 * k + 1];
            if constexpr (SMOOTH) {
                a *= sc[2 * k];
                b *= sc[2 * k + 1];
            }
            if constexpr (CENTER) {
                a += mu[2 * k];
                b += mu[2 * k + 1];
            }
            w[k] = pack_h2(a, b);
        }
        *(uint4*)(out + (size_t)row * D + e0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

extern "C" __global__ void vq_decode_rows(const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
                                          int heads, int stride, int p0, int n,
                                          const unsigned short* __restrict__ kbook,
                                          const unsigned short* __restrict__ vbook, const float* __restrict__ kmean,
                                          const float* __restrict__ kscale, const float* __restrict__ vmean,
                                          const float* __restrict__ vscale, const Around around,
                                          unsigned short* __restrict__ ko, unsigned short* __restrict__ vo) {
    __shared__ __align__(16) unsigned short books[256 * (SDK + SDV)];
    for (int i = threadIdx.x; i < 256 * SDK; i += blockDim.x) books[i] = kbook[i];
    for (int i = threadIdx.x; i < 256 * SDV; i += blockDim.x) books[256 * SDK + i] = vbook[i];
    __syncthreads();
    decode_rows<SDK, CENTER_K, SMOOTH_K, ROTATE_K>(kc, heads, stride, p0, n, books, kmean, kscale, around.k, around,
                                                   ko);
    decode_rows<SDV, CENTER_V, SMOOTH_V, ROTATE_V>(vc, heads, stride, p0, n, books + 256 * SDK, vmean, vscale,
                                                   around.v, around, vo);
}

#define DR ((D + 31) / 32)
// The splits of a tile's launches into its output, a warp per (query, query head): one softmax
// over all, normalised (0 where nothing was seen). o: [S][HQ][t][D], ml: [S][HQ][t][2]; out:
// [t][HQ][D].
extern "C" __global__ void prefill_fold(const float* __restrict__ o, const float* __restrict__ ml, int splits, int t,
                                        int hq_total, float* __restrict__ out) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= t * hq_total) return;
    const int i = warp / hq_total, hq = warp % hq_total;
    const size_t plane = (size_t)hq_total * t, row = (size_t)hq * t + i;
    float m = -1e30f;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, ml[(s * plane + row) * 2]);
    m = warp_max(m);
    float acc[DR], l = 0.f;
#pragma unroll
    for (int k = 0; k < DR; k++) acc[k] = 0.f;
    for (int s = 0; s < splits; s++) {
        const float* x = ml + (s * plane + row) * 2;
        const float w = __expf(x[0] - m);
        const float* src = o + (s * plane + row) * D;
        l = fmaf(w, x[1], l);
#pragma unroll
        for (int k = 0; k < DR; k++)
            if (k * 32 + lane < D) acc[k] = fmaf(w, src[k * 32 + lane], acc[k]);
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int k = 0; k < DR; k++)
        if (k * 32 + lane < D) out[(size_t)warp * D + k * 32 + lane] = acc[k] * inv;
}
