// The flash-decoding merge of decode attention over codes: per query head, the split partials
// (natural-log max, sum, code-space D-vector) and the f16 window rows of its stream become the
// output: softmax over both, the code-space sum rotated back (H, value scale, + μ_v times its
// mass), normalised. One block per stream (b, kv head), a warp per query head: the tensor-core
// split kernel runs it in the last of a stream's blocks to finish (no second launch);
// vq_attend_merge runs it after the table kernel or over the window alone.
//
// Defines: D, HQ, HKV, G (= HQ / HKV), ROTATE, CENTER_V, SMOOTH_V, MERGE_THREADS (threads of
// vq_attend_merge: a warp per query head, at least 8 warps, as the partial sums use all).
// Layouts: q [B][HQ][D] f32; part_o [B][HQ][nsplit][D], part_ml [B][HQ][nsplit][2];
// window [B][HKV][W][D] f16 (W ≤ 64); out [B][HQ][D].

// The f16 rows of one stream: W rows, of which rows [0, n_sink) and ring rows sink_cap + ((head +
// i) mod ring_cap), i < ring_len, hold positions (order is irrelevant to attention); others are
// skipped.
struct WindowMap {
    int n_sink, sink_cap, ring_head, ring_len, ring_cap;
    __device__ bool valid(int t) const {
        return t < n_sink || (t >= sink_cap && (t - sink_cap - ring_head + ring_cap) % ring_cap < ring_len);
    }
};

// A load from L2, past L1: the partials may come from other blocks of the same launch.
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// One step of a reduce-scatter of the 2·O sums p[0, 2·O) over lanes that differ in bit O: each
// lane keeps the half whose index bit O matches its own and adds its partner's share of them
// (compile-time indices, so p stays in registers).
template <int O>
__device__ __forceinline__ void reduce_scatter_step(float (&p)[16], int lane) {
    const bool up = lane & O;
#pragma unroll
    for (int r = 0; r < O; r++) {
        const float send = up ? p[r] : p[r + O];
        const float keep = up ? p[r + O] : p[r];
        p[r] = keep + __shfl_xor_sync(FULL_MASK, send, O);
    }
}

// Scores of window rows [0, min(n, 16)) of `rows` against the warp's query `qs` (lane l holds
// elements 32i + l), row l mod 16's in lane l; rows past n score 0. Each lane sums its elements
// of every row, then one reduce-scatter (8 + 4 + 2 + 1 shuffles, each step's independent of one
// another) and one shuffle across the half-warps: where a sum per row chains 5 dependent
// shuffles 16 times.
__device__ __forceinline__ float window_scores16(const unsigned short* rows, int n, const float (&qs)[D / 32], int lane) {
    float p[16];
#pragma unroll
    for (int r = 0; r < 16; r++) {
        float s = 0.f;
        if (r < n) {
#pragma unroll
            for (int i = 0; i < D / 32; i++) s = fmaf(qs[i], h2f(rows[r * D + i * 32 + lane]), s);
        }
        p[r] = s;
    }
    reduce_scatter_step<8>(p, lane);
    reduce_scatter_step<4>(p, lane);
    reduce_scatter_step<2>(p, lane);
    reduce_scatter_step<1>(p, lane);
    return p[0] + __shfl_xor_sync(FULL_MASK, p[0], 16);
}

// Merges the G query heads of stream (b, h) — its partials at b, its queries and output at packed
// row qb, its window rows at slot (all b outside a ragged batch) — with all NT threads of the block (NT ≥ 32·G; warp w
// < G is head h·G + w's). Everything global is requested in one round trip before the first
// barrier: a head warp's query, value scale and mean and split maxima and sums; every thread's
// first PF partials of its K outputs (head, dim); the block's window rows (into shared memory).
// Then: head warps score the window and publish split weights; all threads sum the partials;
// head warps rotate back, add the window values and store. `smem`: merge_smem bytes, 16-aligned.
template <int NT>
__device__ __noinline__ void merge_stream(const float* __restrict__ q, const float* part_o, const float* part_ml,
                                             const unsigned short* __restrict__ wk, const unsigned short* __restrict__ wv,
                                             const float* __restrict__ vmean, const float* __restrict__ vscale, float* __restrict__ out,
                                             int nsplit, int W, WindowMap wmap, float scale, int b, int h, int qb, int slot,
                                             unsigned char* smem) {
    constexpr int K = (G * D + NT - 1) / NT;        // outputs (head, dim) per thread
    constexpr int PF = 64 / K < 32 ? 64 / K : 32;  // splits of each prefetched
    unsigned short* rows = (unsigned short*)smem;   // [2][W][D] window keys, values
    float* wsm = (float*)(rows + 2 * W * D);        // [G][nsplit] split weights
    float* oc = wsm + G * nsplit;                   // [G][D] code-space sums
    float* lsum = oc + G * D;                       // [G] code mass
    // Window rows (and, launched alone, the splits' partials) come from the kernels before.
    grid_wait();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool head = warp < G;
    const size_t row0 = (size_t)b * HQ + h * G;     // first query head's row of the partials
    const size_t qrow0 = (size_t)qb * HQ + h * G;   // … of the queries and the output
    // Round trip: head warps' inputs…
    float qs[D / 32], vs[D / 32], vm[D / 32], ml[2] = {NEG_MAX, NEG_MAX}, ls[2] = {0.f, 0.f};
    float m = NEG_MAX;
    const size_t base = (row0 + min(warp, G - 1)) * nsplit;
    if (head) {
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int e = i * 32 + lane;
            qs[i] = q[(qrow0 + warp) * D + e] * scale;
            vs[i] = SMOOTH_V ? vscale[h * D + e] : 1.f;
            vm[i] = CENTER_V ? vmean[h * D + e] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
            if (lane + 32 * j < nsplit) {
                ml[j] = ld_cg(part_ml + (base + lane + 32 * j) * 2);
                ls[j] = ld_cg(part_ml + (base + lane + 32 * j) * 2 + 1);
            }
        for (int s = lane + 64; s < nsplit; s += 32) m = fmaxf(m, ld_cg(part_ml + (base + s) * 2));
    }
    // …every thread's first partials…
    float pre[K][PF];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int o = tid + k * NT;
        const float* p = part_o + (row0 + o / D) * nsplit * D + o % D;
#pragma unroll
        for (int s = 0; s < PF; s++) pre[k][s] = o < G * D && s < nsplit ? ld_cg(p + s * D) : 0.f;
    }
    // …and the window rows.
    {
        const uint4* sk = (const uint4*)(wk + ((size_t)slot * HKV + h) * W * D);
        const uint4* sv = (const uint4*)(wv + ((size_t)slot * HKV + h) * W * D);
        uint4* dk = (uint4*)rows;
        uint4* dv = (uint4*)(rows + W * D);
#pragma unroll 4
        for (int i = tid; i < W * D / 8; i += NT) {
            dk[i] = sk[i];
            dv[i] = sv[i];
        }
    }
    __syncthreads();
    // Head warps: window scores (lane t mod 32 keeps row t's; rows holding no position never
    // weigh, they may hold anything), the maximum, split weights into shared memory.
    float wt[2] = {0.f, 0.f}, lw = 0.f;
    if (head) {
        float sc[2] = {NEG_MAX, NEG_MAX};
        bool live[2] = {false, false};
#pragma unroll
        for (int c = 0; c < 2; c++) {
            if (32 * c >= W) break;  // uniform over the warp
            // Rows 32c + [0, 16) and 32c + [16, 32): lane l keeps row 32c + l's.
            const float s0 = window_scores16(rows + 32 * c * D, W - 32 * c, qs, lane);
            const float s1 = 32 * c + 16 < W ? window_scores16(rows + (32 * c + 16) * D, W - 32 * c - 16, qs, lane) : 0.f;
            const float s = lane < 16 ? s0 : s1;
            const int t = 32 * c + lane;
            if (t < W && wmap.valid(t)) {
                sc[c] = s;
                live[c] = true;
            }
        }
        m = warp_max(fmaxf(fmaxf(m, fmaxf(ml[0], ml[1])), fmaxf(sc[0], sc[1])));
#pragma unroll
        for (int j = 0; j < 2; j++) wt[j] = live[j] ? __expf(sc[j] - m) : 0.f;
        lw = warp_sum(wt[0] + wt[1]);
        float lc = 0.f;
#pragma unroll
        for (int j = 0; j < 2; j++)
            if (lane + 32 * j < nsplit) {
                const float w = __expf(ml[j] - m);
                wsm[warp * nsplit + lane + 32 * j] = w;
                lc = fmaf(w, ls[j], lc);
            }
        for (int s = lane + 64; s < nsplit; s += 32) {
            const float w = __expf(ld_cg(part_ml + (base + s) * 2) - m);
            wsm[warp * nsplit + s] = w;
            lc = fmaf(w, ld_cg(part_ml + (base + s) * 2 + 1), lc);
        }
        lc = warp_sum(lc);
        if (lane == 0) lsum[warp] = lc;
    }
    __syncthreads();
    // Every thread: its outputs' sums over the splits.
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int o = tid + k * NT;
        if (o < G * D) {
            const float* w = wsm + (o / D) * nsplit;
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < PF; s++) acc = fmaf(s < nsplit ? w[s] : 0.f, pre[k][s], acc);
            const float* p = part_o + (row0 + o / D) * nsplit * D + o % D;
#pragma unroll 8
            for (int s = PF; s < nsplit; s++) acc = fmaf(w[s], ld_cg(p + s * D), acc);
            oc[o] = acc;
        }
    }
    __syncthreads();
    if (!head) return;
    // Head warps: back from code space, the window values, normalised.
    float v[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; i++) v[i] = oc[warp * D + i * 32 + lane];
    if (ROTATE) warp_fwht<D>(v, lane);
    const float lc = lsum[warp];
#pragma unroll
    for (int i = 0; i < D / 32; i++) v[i] = fmaf(lc, vm[i], v[i] * vs[i]);
    const unsigned short* vrows = rows + W * D;
#pragma unroll 4
    for (int t = 0; t < W; t++) {
        const float w = __shfl_sync(FULL_MASK, t < 32 ? wt[0] : wt[1], t & 31);
        if (w != 0.f) {  // uniform over the warp
#pragma unroll
            for (int i = 0; i < D / 32; i++) v[i] = fmaf(w, h2f(vrows[t * D + i * 32 + lane]), v[i]);
        }
    }
    const float inv = 1.f / (lc + lw);
#pragma unroll
    for (int i = 0; i < D / 32; i++) out[(qrow0 + warp) * D + i * 32 + lane] = v[i] * inv;
}

// A ragged batch's entry for sequence b (8 ints, the host's ragged_entry): its slot, packed query
// row, coded length and window map; outside a ragged batch b's own, S and wmap.
struct Seq {
    int slot, qb, S;
    WindowMap wm;
    __device__ Seq(const int* ragged, int is_ragged, int b, int S_, WindowMap wmap) {
        if (is_ragged) {
            const int* r = ragged + 8 * b;
            slot = r[0];
            qb = r[1];
            S = r[2];
            wm = WindowMap{r[3], r[4], r[5], r[6], r[7]};
        } else {
            slot = qb = b;
            S = S_;
            wm = wmap;
        }
    }
};

// Block (b·HKV + h): merges stream (b, h) after a split kernel that leaves the merge to it, or the
// window rows alone when nothing is coded (nsplit 0); a ragged batch's sequences from its table.
// Dynamic shared memory: merge_smem bytes.
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) vq_attend_merge(
    const float* __restrict__ q, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    const unsigned short* __restrict__ wk, const unsigned short* __restrict__ wv, const float* __restrict__ vmean,
    const float* __restrict__ vscale, float* __restrict__ out, int nsplit, int W, WindowMap wmap, float scale,
    const int* __restrict__ ragged, int is_ragged) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int b = blockIdx.x / HKV;
    const Seq s(ragged, is_ragged, b, 0, wmap);
    merge_stream<MERGE_THREADS>(q, part_o, part_ml, wk, wv, vmean, vscale, out, nsplit, W, s.wm, scale, b, blockIdx.x % HKV, s.qb, s.slot, smem);
}
