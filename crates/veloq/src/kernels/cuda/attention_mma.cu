// Decode attention over VecInfer codes on tensor cores, flash-decoding split over the sequence, for
// sub-vectors of 4 (2 bits per element) or 2 (4 bits) with 256 centroids, keys and values each
// their own, and GQA groups of up to 8 heads.
// It writes the same partials as vq_attend_split; with `fuse` (when the merge's shared memory fits
// in the kernel's), the last of a stream's blocks to finish merges them with the window rows
// (merge_stream, merge.cu) into the output: one launch per layer. Launched to overlap the kernel
// before it (launch.rs): with `early` (that kernel wrote window rows only) the splits run before
// waiting for it.
//
// A ragged batch (sequences at different positions) is one launch too: a table gives each
// sequence its slot, query row, coded length and window map (blocks past a sequence's length write
// empty partials and still count for the merge).
//
// Block (split, stream). Each warp walks its own run of the split 16 positions at a time with an
// online softmax; the block folds its warps' (max, sum, code-space D-vector) per head at the end.
//
// Scores: S = K̂ · Q̃^T with mma.m16n8k16 (rows: 16 positions; columns: the group's query heads,
// zero-padded to 8; k: 16 dims = 4 sub-spaces). The dims of a k-tile are ordered so that a lane's
// pairs (2q, 2q+1) and (2q+8, 2q+9) are elements (0, 1) and (2, 3) of one sub-space: its A
// fragment for positions g and g + 8 is their two centroids, four f16s each, two 8-byte shared
// loads. Lane q of a quad takes sub-spaces q·KT + kt, so its code bytes of a position are
// contiguous (one load per position and step). With key sub-vectors of 2 the same dims are two
// sub-spaces, q·2KT + 2kt and the next: each register of the A fragment is one centroid (four
// 4-byte shared loads), and the query fragments are the same.
// Softmax: online, per head over the steps, lazily: the reference maximum moves only when a score
// passes it by more than 2^8, so most steps need no shuffles. The weights (position, head) become
// the (head, position) B fragments of the value mma with one movmatrix transpose each.
// Values: O^T += V̂^T · P^T (rows: 16 dims = 8 sub-spaces × 2 elements; k: 16 positions; columns:
// heads); the A fragment pairs two positions' elements of one sub-space (two centroid loads and
// byte permutes per register pair). Lane group g takes sub-spaces g·VP + u. With value
// sub-vectors of 2, a tile's 16 dims are the two elements of 8 sub-spaces g·VB + u, one m-tile per
// u. With value sub-vectors of 2 and at most 4 heads (VH), O^T's columns are (head,
// element): rows are 16 sub-spaces, k 8 positions × 2 elements, so a register of the A fragment
// is one centroid and a step is two k-chunks; the weights reach the B fragments by shuffles.
// The value codes of a
// step are fetched two steps ahead, the key codes one, and a step's value mma is issued between
// the next step's score mma and softmax (two independent streams for the schedulers).
// Neither keys nor values are ever decoded outside registers.
//
// Both codebooks sit in shared memory as f16, interleaved per centroid, [centroid][key, value]
// [replica] (256 bytes per centroid, 128 per book): centroids of 4 replicated 16 times, so the 16
// lanes of an 8-byte load phase read 16 distinct bank pairs whatever their random codes; of 2, 32
// times, one bank per lane of a 4-byte load. A lane's entry offset, code·256 + its replica's, is
// one byte permute of the code word.
//
// Defines: D (64, 128 or 256), SDK and SDV (key and value sub_dim, 2 or 4), HQ, HKV, G (= HQ / HKV
// ≤ 8), CENTER_K, SMOOTH_K, CENTER_V, SMOOTH_V, ROTATE, WARPS, MIN_BLOCKS.
// Layouts: q [B][HQ][D] f32; codes [B·HKV][stride][D/SD] u8; books [256][SD] f16; partials as
// vq_attend_split: part_o [B][HQ][nsplit][D], part_ml [B][HQ][nsplit][2] (natural-log max, sum);
// done [B·HKV] blocks finished per stream (zero between launches).

#define M_K (D / SDK)         // key sub-spaces (code bytes per position)
#define M_V (D / SDV)         // value sub-spaces
#define KT (D / 16)           // key k-tiles
#define MT (D / 16)           // value m-tiles
#define VP (D / 32)           // value m-tile pairs (sub-vectors of 4)
#define KB (D / (4 * SDK))    // a lane's key code bytes per position
#define VB (D / (8 * SDV))    // a lane's value code bytes per position
#define KW ((KB + 3) / 4)     // words of them
#define VW ((VB + 3) / 4)
// VH: with value sub-vectors of 2 and at most 4 heads the value mma's columns are (head,
// element) pairs, so each A register is one centroid as the book holds it (no byte permutes) and
// no column is padding (half the accumulators); lane group g takes sub-spaces g·VB + j.
#define VH (SDV == 2 && G <= 4)
#define OT (VH ? D / 32 : MT)  // value accumulator tiles
#define LOG2E 1.4426950408889634f

#if G > 8 || G > WARPS || (D != 64 && D != 128 && D != 256) || (SDK != 2 && SDK != 4) || (SDV != 2 && SDV != 4)
#error "vq_attend_mma takes D 64/128/256, sub_dims 2 or 4 and at most 8 query heads per kv head"
#endif

// A centroid of SD f16s in shared memory, and the replicas of a book.
template <int SD> struct Cent;
template <> struct Cent<4> {
    typedef uint2 T;
    enum { R = 16 };
};
template <> struct Cent<2> {
    typedef unsigned T;
    enum { R = 32 };
};

// Transpose of an 8×8 matrix of f16 held as mma fragments (lane l: row l/4, columns 2(l%4), +1).
__device__ __forceinline__ unsigned transpose8(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Bytes of a and b picked by selector s (PTX prmt): 0x5410 = low halves, 0x7632 = high halves.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// Byte offset of the centroid whose code is byte i of the words w, in the book starting at base8
// (< 256) of its 256-byte row: code · 256 + base8.
__device__ __forceinline__ unsigned entry(const unsigned* w, int i, unsigned base8) {
    return prmt(w[i >> 2], base8, 0x5504u | ((unsigned)(i & 3) << 4));
}

// Code loads: read once, so not allocated in L1 (`ld.global.nc.L1::no_allocate`), which keeps L1
// for the codebooks; an L2 evict-first policy instead cost time (NOTES.md, t11, has the timings).
__device__ __forceinline__ void ld_code(unsigned (&w)[1], const unsigned short* p) {
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=r"(w[0]) : "l"(p));
}
__device__ __forceinline__ void ld_code(unsigned (&w)[1], const unsigned* p) {
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
}
__device__ __forceinline__ void ld_code(unsigned (&w)[2], const uint2* p) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
}
__device__ __forceinline__ void ld_code(unsigned (&w)[4], const uint4* p) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}

// N code bytes of one position (a lane's share): one load, two for 32 bytes.
template <int N>
__device__ __forceinline__ void load_bytes(unsigned (&w)[(N + 3) / 4], const unsigned char* p) {
    if constexpr (N == 2) {
        ld_code(w, (const unsigned short*)p);
    } else if constexpr (N == 4) {
        ld_code(w, (const unsigned*)p);
    } else if constexpr (N == 8) {
        ld_code(w, (const uint2*)p);
    } else if constexpr (N == 16) {
        ld_code(w, (const uint4*)p);
    } else {
        static_assert(N == 32, "2 to 32 code bytes");
        unsigned(&lo)[4] = *reinterpret_cast<unsigned(*)[4]>(&w[0]);
        unsigned(&hi)[4] = *reinterpret_cast<unsigned(*)[4]>(&w[4]);
        ld_code(lo, (const uint4*)p);
        ld_code(hi, (const uint4*)p + 1);
    }
}

// One book into shared memory: centroid c's R replicas at byte c·256 + OFF (0 keys, 128 values).
// Every load is requested before the first store.
template <int SD, int OFF, int THREADS>
__device__ __forceinline__ void fill_book(unsigned char* smem, const void* __restrict__ book, int tid) {
    typedef typename Cent<SD>::T T;
    constexpr int R = Cent<SD>::R, PER = 256 * R / THREADS, CS = THREADS / R;
    const int r = tid % R, c0 = tid / R;
    T e[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) e[k] = ((const T*)book)[c0 + k * CS];
#pragma unroll
    for (int k = 0; k < PER; k++) ((T*)(smem + (c0 + k * CS) * 256 + OFF))[r] = e[k];
}

// MIN_BLOCKS (host, which plans the splits' waves by it): blocks per multiprocessor, capping the
// registers per thread: 2 (16 warps, 128 registers), 1 at head_dim 256 (it needs more).

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) vq_attend_mma(
    const float* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned char* __restrict__ vcodes,
    const void* __restrict__ kbook, const void* __restrict__ vbook, const float* __restrict__ kmean,
    const float* __restrict__ kscale, float* part_o, float* part_ml, int S, long long stride, int split, float scale,
    const unsigned short* __restrict__ wk, const unsigned short* __restrict__ wv, const float* __restrict__ vmean,
    const float* __restrict__ vscale, float* __restrict__ out, int W, WindowMap wmap, unsigned* __restrict__ done, int fuse, int early,
    const int* __restrict__ ragged, int is_ragged) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // [256][key, value][replicas] centroids: 256 bytes each.
    float* qt = (float*)(smem_raw + 256 * 256); // [G][D] queries in code space, log2 units
    float* off = qt + G * D;                // [8] key-centering offsets (natural units)
    float* wml = off + 8;                   // [WARPS][2][8] warp maxima (log2) and sums
    float* wo = (float*)smem_raw;           // [WARPS][G][D] warp partials, over the books at the end

    const int sp = blockIdx.x, bh = blockIdx.y, nsplit = gridDim.x;
    const int h = bh % HKV, b = bh / HKV;
    // A ragged batch (`is_ragged`): sequence b's slot, packed query row, coded length and window
    // map from the host's table (Seq, merge.cu). Written before the launch by a copy, never by the
    // kernel before this one.
    const Seq seq(ragged, is_ragged, b, S, wmap);
    const int slot = seq.slot, qb = seq.qb, Sb = seq.S;
    const WindowMap wm = seq.wm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, qd = lane & 3, rl = lane & 15;
    const int t0 = sp * split, t1 = min(Sb, t0 + split), n = max(0, t1 - t0);
    // Overlapped launch (launch.rs): with `early` the host vouches that the kernel before this
    // one writes only window rows, which only the fused merge reads (it waits there); else wait
    // now (a separate merge waits for this kernel, so its end must cover the one before).
    grid_launch_dependents();
    if (!early) grid_wait();

    // This warp's run: whole steps of 16 positions.
    const int per = ((n + WARPS - 1) / WARPS + 15) & ~15;
    const int w0 = t0 + min(n, warp * per), w1 = min(t1, w0 + per);
    const unsigned char* kc = kcodes + ((size_t)slot * HKV + h) * stride * M_K;
    const unsigned char* vc = vcodes + ((size_t)slot * HKV + h) * stride * M_V;
    // Key codes of positions st + 8·nt + g (bytes qd·KB …), value codes of st + 2qd + {0, 1, 8, 9}
    // (bytes g·VB …); positions past the run read its last one (their weights are zeroed).
    // Running pointers to the codes of the step after the current one.
    const unsigned char* kp = kc + (size_t)(w0 + 16 + g) * M_K + qd * KB;
#if VH
    const unsigned char* vp = vc + (size_t)(w0 + 16 + qd) * M_V + g * VB;
#else
    const unsigned char* vp = vc + (size_t)(w0 + 16 + 2 * qd) * M_V + g * VB;
#endif
    // Value positions of a lane relative to 2qd (VH: qd): i < 4 → +{0, 1, 8, 9} (VH: +4i).
    auto vrow = [&](int i) { return VH ? 4 * i : (i & 1) + 8 * (i >> 1); };
    // The codes of the step at st: at fixed offsets from p where the step is `whole` (16 positions
    // of the run), else clamped to the run's last position.
    auto load_keys = [&](unsigned (&kw)[2][KW], int st, const unsigned char* p, bool whole) {
        if (whole) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) load_bytes<KB>(kw[nt], p + nt * 8 * M_K);
        } else {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) load_bytes<KB>(kw[nt], kc + (size_t)min(st + nt * 8 + g, w1 - 1) * M_K + qd * KB);
        }
    };
    auto load_values = [&](unsigned (&vw)[4][VW], int st, const unsigned char* p, bool whole) {
        if (whole) {
#pragma unroll
            for (int i = 0; i < 4; i++) load_bytes<VB>(vw[i], p + vrow(i) * M_V);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) load_bytes<VB>(vw[i], vc + (size_t)min(st + (VH ? qd : 2 * qd) + vrow(i), w1 - 1) * M_V + g * VB);
        }
    };
    // Codes in registers: keys of this step (kw) and the next (kn); values of the previous step
    // (vw, accumulated during this one), of this one (vcur), and of the next (vn, being fetched).
    // The first are requested now; they arrive while the books and queries are prepared.
    unsigned kw[2][KW], vw[4][VW], kn[2][KW], vn[4][VW], vcur[4][VW];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int k = 0; k < VW; k++) vw[i][k] = 0u;  // centroid 0 with zero weights before the first step
    if (w0 < w1) {
        load_keys(kw, w0, kp - 16 * M_K, w0 + 16 <= w1);
        load_values(vcur, w0, vp - 16 * M_V, w0 + 16 <= w1);
    }

    // Everything global that the prologue needs is requested at once: this warp's query head (warps
    // < G) with its centering and smoothing, and the books (each thread 16 centroids per book;
    // a warp's stores then fill two 128-byte rows: no bank conflicts).
    float qv[D / 32], km[D / 32], ks[D / 32];
    if (warp < G) {
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int e = i * 32 + lane;
            qv[i] = q[((size_t)qb * HQ + h * G + warp) * D + e];
            km[i] = CENTER_K ? kmean[h * D + e] : 0.f;
            ks[i] = SMOOTH_K ? kscale[h * D + e] : 1.f;
        }
    }
#if SDK == 4 && SDV == 4
    {
        uint2* books = (uint2*)smem_raw;
        constexpr int PER = 256 * 16 / (WARPS * 32);
        const int r = tid % 16, c0 = tid / 16, cs = WARPS * 32 / 16;
        uint2 ke[PER], ve[PER];
#pragma unroll
        for (int k = 0; k < PER; k++) {
            ke[k] = ((const uint2*)kbook)[c0 + k * cs];
            ve[k] = ((const uint2*)vbook)[c0 + k * cs];
        }
#pragma unroll
        for (int k = 0; k < PER; k++) {
            books[(c0 + k * cs) * 32 + r] = ke[k];
            books[(c0 + k * cs) * 32 + 16 + r] = ve[k];
        }
    }
#else
    fill_book<SDK, 0, WARPS * 32>(smem_raw, kbook, tid);
    fill_book<SDV, 128, WARPS * 32>(smem_raw, vbook, tid);
#endif
    // q̃ = H(s ⊙ q·scale), the offset q·scale·μ_k (scores are q̃·ĉ + offset).
    if (warp < G) {
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const float f = qv[i] * scale;
            o = fmaf(f, km[i], o);
            qv[i] = f * ks[i];
        }
        if (ROTATE) warp_fwht<D>(qv, lane);
#pragma unroll
        for (int i = 0; i < D / 32; i++) qt[warp * D + i * 32 + lane] = qv[i] * LOG2E;
        o = warp_sum(o);
        if (lane == 0) off[warp] = o;
    }
    __syncthreads();
    // This lane's replica in the key / value book.
    const unsigned kl8 = SDK == 4 ? rl * 8 : lane * 4, vl8 = 128 + (SDV == 4 ? rl * 8 : lane * 4);

    // Query fragments, head g (zero for g ≥ G): k-tile kt, lane q → dims 4(q·KT + kt) + 0…3 (one
    // sub-space of 4, or two of 2): the B columns of Q̃^T.
    unsigned qf[KT][2];
#pragma unroll
    for (int kt = 0; kt < KT; kt++) {
        if (g < G) {
            const float4 v = *(const float4*)(qt + g * D + 4 * (qd * KT + kt));
            qf[kt][0] = pack_h2(v.x, v.y);
            qf[kt][1] = pack_h2(v.z, v.w);
        } else {
            qf[kt][0] = 0u;
            qf[kt][1] = 0u;
        }
    }

    float o[OT][4];
#pragma unroll
    for (int mt = 0; mt < OT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[mt][i] = 0.f;

    // O^T += V̂^T · P^T over one step: value codes vw, weights pb (P^T fragments: positions 2q,
    // 2q+1 and 2q+8, 2q+9 of head g).
#if VH
    // VH: k-chunk 1's weights (chunk 0's are pb0, pb1); the B fragment of column g holds head
    // g / 2's weight in half g mod 2 and zero in the other: this lane's byte selector over (the
    // weights of heads 2(g/4) and 2(g/4) + 1, zero).
    unsigned pb2 = 0u, pb3 = 0u;
    const unsigned hs = (g >> 1) & 1, psel = (g & 1) ? 0x44u | (2 * hs) << 8 | (2 * hs + 1) << 12 : (2 * hs) | (2 * hs + 1) << 4 | 0x4400u;
#endif
    auto accumulate = [&](const unsigned (&vw)[4][VW], unsigned pb0, unsigned pb1) {
#if VH
        // Tile mt: rows g and g + 8 are sub-spaces g·VB + 2mt and the next (bytes 2mt, 2mt + 1 of
        // the lane's codes); k-chunk c's positions t and t + 4 are vw[2c] and vw[2c + 1].
        auto cent = [&](const unsigned (&w)[VW], int j) { return *(const unsigned*)(smem_raw + entry(w, j, vl8)); };
#pragma unroll
        for (int mt = 0; mt < OT; mt++) {
            mma_16816(o[mt], cent(vw[0], 2 * mt), cent(vw[0], 2 * mt + 1), cent(vw[1], 2 * mt), cent(vw[1], 2 * mt + 1), pb0, pb1);
            mma_16816(o[mt], cent(vw[2], 2 * mt), cent(vw[2], 2 * mt + 1), cent(vw[3], 2 * mt), cent(vw[3], 2 * mt + 1), pb2, pb3);
        }
#elif SDV == 2
        // Tile u: rows g and g + 8 are elements 0 and 1 of sub-space g·VB + u.
#pragma unroll
        for (int u = 0; u < MT; u++) {
            unsigned c[4];
#pragma unroll
            for (int i = 0; i < 4; i++) c[i] = *(const unsigned*)(smem_raw + entry(vw[i], u, vl8));
            mma_16816(o[u], prmt(c[0], c[1], 0x5410), prmt(c[0], c[1], 0x7632), prmt(c[2], c[3], 0x5410), prmt(c[2], c[3], 0x7632), pb0, pb1);
        }
#else
#pragma unroll
        for (int u = 0; u < VP; u++) {
            uint2 c[4];
#pragma unroll
            for (int i = 0; i < 4; i++) c[i] = *(const uint2*)(smem_raw + entry(vw[i], u, vl8));
            mma_16816(o[2 * u], prmt(c[0].x, c[1].x, 0x5410), prmt(c[0].x, c[1].x, 0x7632), prmt(c[2].x, c[3].x, 0x5410), prmt(c[2].x, c[3].x, 0x7632), pb0, pb1);
            mma_16816(o[2 * u + 1], prmt(c[0].y, c[1].y, 0x5410), prmt(c[0].y, c[1].y, 0x7632), prmt(c[2].y, c[3].y, 0x5410), prmt(c[2].y, c[3].y, 0x7632), pb0, pb1);
        }
#endif
    };
    // Rescales the value accumulators of heads 2q (columns 0, 2) and 2q+1 (1, 3).
    auto rescale = [&](float a0, float a1) {
#if VH
        // A lane's accumulators are all head q's, whose factor lane q / 2 holds.
        const float f0 = __shfl_sync(FULL_MASK, a0, qd >> 1), f1 = __shfl_sync(FULL_MASK, a1, qd >> 1);
        const float a = (qd & 1) ? f1 : f0;
#pragma unroll
        for (int mt = 0; mt < OT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) o[mt][i] *= a;
#else
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            o[mt][0] *= a0;
            o[mt][1] *= a1;
            o[mt][2] *= a0;
            o[mt][3] *= a1;
        }
#endif
    };

    // One step of 16 positions at st: scores from key codes kw, then the value accumulation of the
    // previous step (codes vw, weights pb), which the schedulers overlap with the scoring, then
    // the online softmax → pb. Meanwhile the next step's key and value codes (kn, vn) are fetched.
    unsigned pb0 = 0u, pb1 = 0u;  // zero weights before the first step
    // S = K̂ · Q̃^T: rows positions g (codes kw[0]) and g + 8 (kw[1]), columns heads. A lane keeps
    // the softmax state of heads 2q, 2q+1: the heads of its value accumulators.
    float mrow[2] = {NEG_MAX, NEG_MAX}, lrow[2] = {0.f, 0.f};
    // `inner`: this step and the next are whole (no bounds anywhere), a literal at each call.
    auto step = [&](const unsigned (&kw)[2][KW], const unsigned (&vw)[4][VW], unsigned (&kn)[2][KW], unsigned (&vn)[4][VW], int st, bool inner) {
        if (inner || st + 16 < w1) {
            const bool whole = inner || st + 32 <= w1;
            load_keys(kn, st + 16, kp, whole);
            load_values(vn, st + 16, vp, whole);
        }
        kp += 16 * M_K;
        vp += 16 * M_V;
        float s[4] = {0.f, 0.f, 0.f, 0.f};  // (g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)
#pragma unroll
        for (int kt = 0; kt < KT; kt++) {
#if SDK == 4
            const uint2 a = *(const uint2*)(smem_raw + entry(kw[0], kt, kl8));
            const uint2 c = *(const uint2*)(smem_raw + entry(kw[1], kt, kl8));
            mma_16816(s, a.x, c.x, a.y, c.y, qf[kt][0], qf[kt][1]);
#else
            // Sub-spaces 2kt and 2kt + 1 of the lane's: columns (2q, 2q+1) and (2q+8, 2q+9), read
            // by byte offset (an index costs a mask per lookup: the compiler cannot see that the
            // offsets are multiples of 4).
            auto cent = [&](const unsigned (&w)[KW], int j) { return *(const unsigned*)(smem_raw + entry(w, j, kl8)); };
            const unsigned a0 = cent(kw[0], 2 * kt), a1 = cent(kw[0], 2 * kt + 1);
            const unsigned c0 = cent(kw[1], 2 * kt), c1 = cent(kw[1], 2 * kt + 1);
            mma_16816(s, a0, c0, a1, c1, qf[kt][0], qf[kt][1]);
#endif
        }
        accumulate(vw, pb0, pb1);
        if (!inner && st + 16 > w1) {  // the run's last, partial step
            if (st + g >= w1) s[0] = s[1] = __int_as_float(0xff800000);  // -inf
            if (st + 8 + g >= w1) s[2] = s[3] = __int_as_float(0xff800000);
        }
        // Online softmax over the 16 positions (lanes of equal q) of heads 2q, 2q+1, lazily: the
        // reference maximum moves only when a score passes it by more than 8 (log2 units), so
        // weights stay ≤ 2^8 (exact enough in f16) and most steps need one vote, no shuffles.
        float t0m = fmaxf(s[0], s[2]), t1m = fmaxf(s[1], s[3]);
        if (__any_sync(FULL_MASK, t0m > mrow[0] + 8.f || t1m > mrow[1] + 8.f)) {
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) {
                t0m = fmaxf(t0m, __shfl_xor_sync(FULL_MASK, t0m, x));
                t1m = fmaxf(t1m, __shfl_xor_sync(FULL_MASK, t1m, x));
            }
            const float m0 = fmaxf(mrow[0], t0m), m1 = fmaxf(mrow[1], t1m);
            const float a0 = ex2(mrow[0] - m0), a1 = ex2(mrow[1] - m1);
            mrow[0] = m0;
            mrow[1] = m1;
            lrow[0] *= a0;
            lrow[1] *= a1;
            rescale(a0, a1);
        }
        const float p0 = ex2(s[0] - mrow[0]), p1 = ex2(s[1] - mrow[1]), p2 = ex2(s[2] - mrow[0]), p3 = ex2(s[3] - mrow[1]);
        lrow[0] += p0 + p2;
        lrow[1] += p1 + p3;
        // (position, head) fragments → (head, position): the P^T fragments of the value mma.
#if VH
        // Row r's weights of heads 2q, 2q + 1 are lane (r mod 8, q)'s (r ≥ 8: its second pair):
        // this lane takes rows t and t + 4 of each chunk, heads of its quad position g / 4.
        const unsigned x0 = pack_h2(p0, p1), x1 = pack_h2(p2, p3);
        const int s0 = 4 * qd + (g >> 2), s1 = s0 + 16;
        pb0 = prmt(__shfl_sync(FULL_MASK, x0, s0), 0u, psel);
        pb1 = prmt(__shfl_sync(FULL_MASK, x0, s1), 0u, psel);
        pb2 = prmt(__shfl_sync(FULL_MASK, x1, s0), 0u, psel);
        pb3 = prmt(__shfl_sync(FULL_MASK, x1, s1), 0u, psel);
#else
        pb0 = transpose8(pack_h2(p0, p1));
        pb1 = transpose8(pack_h2(p2, p3));
#endif
    };
    auto rotate = [&]() {
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int k = 0; k < KW; k++) kw[nt][k] = kn[nt][k];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int k = 0; k < VW; k++) {
                vw[i][k] = vcur[i][k];
                vcur[i][k] = vn[i][k];
            }
    };
    int st = w0;
    for (; st + 32 <= w1; st += 16) {  // no bounds
        step(kw, vw, kn, vn, st, true);
        rotate();
    }
    for (; st < w1; st += 16) {  // the last one or two steps
        step(kw, vw, kn, vn, st, false);
        rotate();
    }
    if (w0 < w1) accumulate(vw, pb0, pb1);  // the last step's values

    // Fold the warps: partials over the (no longer read) codebooks.
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) lrow[j] += __shfl_xor_sync(FULL_MASK, lrow[j], x);
    if (g == 0) {
#pragma unroll
        for (int j = 0; j < 2; j++)
            if (2 * qd + j < G) {
                wml[warp * 16 + 2 * qd + j] = mrow[j];
                wml[warp * 16 + 8 + 2 * qd + j] = lrow[j];
            }
    }
#if VH
    // Lane (g, q): head q's dims 2(g·VB + 2mt) … + 3.
    if (qd < G)
#pragma unroll
        for (int mt = 0; mt < OT; mt++) *(float4*)(wo + (warp * G + qd) * D + 2 * g * VB + 4 * mt) = make_float4(o[mt][0], o[mt][1], o[mt][2], o[mt][3]);
#else
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int dim = SDV == 4 ? 4 * (g * VP + (mt >> 1)) + 2 * (mt & 1) : 2 * (g * VB + mt);
        if (2 * qd < G) {
            wo[(warp * G + 2 * qd) * D + dim] = o[mt][0];
            wo[(warp * G + 2 * qd) * D + dim + 1] = o[mt][2];
        }
        if (2 * qd + 1 < G) {
            wo[(warp * G + 2 * qd + 1) * D + dim] = o[mt][1];
            wo[(warp * G + 2 * qd + 1) * D + dim + 1] = o[mt][3];
        }
    }
#endif
    __syncthreads();
    for (int i = tid; i < G * D; i += WARPS * 32) {
        const int hh = i / D, d = i % D;
        float mx = NEG_MAX;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, wml[w * 16 + hh]);
        float acc = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float f = ex2(wml[w * 16 + hh] - mx);
            acc = fmaf(f, wo[(w * G + hh) * D + d], acc);
            l = fmaf(f, wml[w * 16 + 8 + hh], l);
        }
        const size_t part = (size_t)(b * HQ + h * G + hh) * nsplit + sp;
        part_o[part * D + d] = acc;
        if (d == 0) {
            part_ml[part * 2] = n > 0 ? mx / LOG2E + off[hh] : NEG_MAX;
            part_ml[part * 2 + 1] = n > 0 ? l : 0.f;
        }
    }

    // With `fuse`, the last of the stream's blocks to finish merges them with the window rows.
    // One thread counts the block done with an acquire-release add after the barrier: the
    // release covers every thread's partials (the barrier orders them before it), the acquire
    // every partial the blocks counted before wrote, and the barrier after hands both to the
    // whole block. (`__threadfence()` is a sequentially consistent fence, fence.sc.gpu: more
    // than this needs, twice, in every thread.)
    if (!fuse) return;
    __shared__ bool last;
    __syncthreads();
    if (tid == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(done + bh) : "memory");
        last = before == (unsigned)nsplit - 1u;
    }
    __syncthreads();
    if (!last) return;
    merge_stream<WARPS * 32>(q, part_o, part_ml, wk, wv, vmean, vscale, out, nsplit, W, wm, scale, b, h, qb, slot, smem_raw);
    if (tid == 0) done[bh] = 0u;  // ready for the next launch
}
