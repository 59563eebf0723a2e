// Fused VecInfer quantize: f16 head vectors → centering,
// smoothing, Hadamard, nearest-centroid search (‖c‖² − 2x·c, running argmin in registers, ties to
// the lowest index), packed codes. One launch, no intermediate in device memory.
//
// Defines: D, SD, K (centroids), BITS, M (= D/SD, a multiple of 8), BOOKS (1 or M), HEADS, ROWS
// (rows per tile), ROTATE, GRID (cells per axis of the books' candidate lists, 0 for none; only
// SD = 2, one book, K ≤ 256). Centering and smoothing are per job (bits of `flags`: 1 center, 2
// smooth for job 0; 4 and 8 for job 1), so a layer's key and value codecs of one geometry share
// the kernel.
//
// Jobs: blockIdx.y picks job 0 or 1 — its input, tables and output — over the same rows (a
// flush codes a ring's keys and values in one launch).
//
// Block: tiles of `tile_rows` ≤ ROWS rows (the host makes them smaller when there are few rows, so a
// flush of a few ring rows spreads over the multiprocessors instead of one block). Phase A: each
// warp transforms rows into shared memory. Phase B: groups of `slices` consecutive threads search
// (row, sub-space) pairs two at a time, each thread over every slices-th centroid of the codebook
// in shared memory (a group's lanes read neighbouring centroids, other groups the same ones), then the
// group's lanes agree on the nearest by shuffles (lower distance, then lower index: the same
// winner as one thread scanning all K in order). With many rows `slices` is 1; with few it spreads
// each search over a group so that every thread of the block has work. Phase C: groups of 8
// codes are packed into BITS bytes each (8 codes always end on a byte boundary).
//
// Grid (GRID > 0 and `grid_on`): each job's book comes with candidate lists (codec/search/grid.rs):
// a sub-vector's cell ⌊(x − lo)·inv⌋ lists, in ascending order, every centroid that can win the
// full scan, so the search scans that list (a thread's share of it with `slices`), or every
// centroid outside the grid; same distance formula, same winner.
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

// The nearer of (d, i) and (e, j): lower distance, then lower index.
__device__ __forceinline__ void nearer(float& d, int& i, float e, int j) {
    if (e < d || (e == d && j < i)) {
        d = e;
        i = j;
    }
}

// Nearest centroids of xa (book c0, norms n0) and xb (c1, n1) among k = first, first + step, …
// (STEP: a step fixed at compile time, else `step`), updating the running (distance, index).
template <int STEP>
__device__ __forceinline__ void search(const float (&xa)[SD], const float (&xb)[SD], const float* c0, const float* c1,
                                       const float* n0, const float* n1, int first, float& best0, int& bi0,
                                       float& best1, int& bi1, int step = STEP) {
    if (STEP > 0) step = STEP;
#pragma unroll 4
    for (int k = first; k < K; k += step) {
        float d0 = 0.f, d1 = 0.f;
        if (SD % 4 == 0) {
#pragma unroll
            for (int d = 0; d < SD; d += 4) {
                const float4 a = *(const float4*)(c0 + k * SD + d);
                const float4 b = BOOKS == 1 ? a : *(const float4*)(c1 + k * SD + d);
                d0 = fmaf(xa[d], a.x, d0);
                d0 = fmaf(xa[d + 1], a.y, d0);
                d0 = fmaf(xa[d + 2], a.z, d0);
                d0 = fmaf(xa[d + 3], a.w, d0);
                d1 = fmaf(xb[d], b.x, d1);
                d1 = fmaf(xb[d + 1], b.y, d1);
                d1 = fmaf(xb[d + 2], b.z, d1);
                d1 = fmaf(xb[d + 3], b.w, d1);
            }
        } else {
#pragma unroll
            for (int d = 0; d < SD; d++) {
                d0 = fmaf(xa[d], c0[k * SD + d], d0);
                d1 = fmaf(xb[d], c1[k * SD + d], d1);
            }
        }
        d0 = fmaf(-2.f, d0, n0[k]);
        d1 = fmaf(-2.f, d1, n1[k]);
        if (d0 < best0) { best0 = d0; bi0 = k; }
        if (d1 < best1) { best1 = d1; bi1 = k; }
    }
}

#if GRID
// This thread's share (k = list[sl], list[sl + slices], …) of the scan for the nearest centroid
// of x (book c, norms n): the list of x's cell, or every centroid outside the grid. `box`: lo₀,
// lo₁, inv₀, inv₁.
__device__ __forceinline__ void grid_search(const float (&x)[SD], const float* c, const float* n,
                                            const unsigned short* off, const unsigned char* ent, float4 box, int sl,
                                            int slices, float& best, int& bi) {
    const float f0 = (x[0] - box.x) * box.z, f1 = (x[1] - box.y) * box.w;
    const bool listed = f0 >= 0.f && f0 < (float)GRID && f1 >= 0.f && f1 < (float)GRID;
    int a = 0, b = K;
    if (listed) {
        const int cell = (int)f0 * GRID + (int)f1;
        a = __ldg(off + cell);
        b = __ldg(off + cell + 1);
    }
    for (int i = a + sl; i < b; i += slices) {
        const int k = listed ? __ldg(ent + i) : i;
        float d = fmaf(x[0], c[k * 2], 0.f);
        d = fmaf(x[1], c[k * 2 + 1], d);
        d = fmaf(-2.f, d, n[k]);
        if (d < best) { best = d; bi = k; }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(256) vq_quantize(
    const unsigned short* __restrict__ x0, const unsigned short* __restrict__ x1, const float* __restrict__ mean0,
    const float* __restrict__ mean1, const float* __restrict__ inv0, const float* __restrict__ inv1,
    const float* __restrict__ books0, const float* __restrict__ books1, const float* __restrict__ norms0,
    const float* __restrict__ norms1, unsigned char* __restrict__ out0, unsigned char* __restrict__ out1, int flags,
    int n_rows, int tile_rows, int slices, RowMap map, const float* __restrict__ gbox0,
    const float* __restrict__ gbox1, const unsigned short* __restrict__ goff0, const unsigned short* __restrict__ goff1,
    const unsigned char* __restrict__ gent0, const unsigned char* __restrict__ gent1, int grid_on) {
    extern __shared__ __align__(16) float smem[];
    const bool job = blockIdx.y;
    const unsigned short* x = job ? x1 : x0;
    const float* mean = job ? mean1 : mean0;
    const float* inv_scale = job ? inv1 : inv0;
    const float* books = job ? books1 : books0;
    const float* norms = job ? norms1 : norms0;
    unsigned char* out = job ? out1 : out0;
    const bool center = (flags >> (2 * job)) & 1, smooth = (flags >> (2 * job + 1)) & 1;
    float* cb = smem;                                   // [BOOKS][K][SD]
    float* nb = cb + BOOKS * K * SD;                    // [BOOKS][K]
    float* tile = nb + BOOKS * K;                       // [ROWS][D]
    unsigned short* codes = (unsigned short*)(tile + ROWS * D);  // [ROWS * M]
    for (int i = threadIdx.x; i < BOOKS * K * SD; i += blockDim.x) cb[i] = books[i];
    for (int i = threadIdx.x; i < BOOKS * K; i += blockDim.x) nb[i] = norms[i];
#if GRID
    // The lists stay in global memory (read through the read-only cache: a search reads one
    // cell's offsets and its few entries), so a launch of a few rows stages nothing more.
    const unsigned short* goff = job ? goff1 : goff0;
    const unsigned char* gent = job ? gent1 : gent0;
    const float4 box = grid_on ? *(const float4*)(job ? gbox1 : gbox0) : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    // This thread's search group (`slices` consecutive lanes) and its place in it.
    const int groups = blockDim.x / slices, grp = threadIdx.x / slices, sl = threadIdx.x % slices;
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
                if (center) f -= mean[head * D + e];
                if (smooth) f *= inv_scale[head * D + e];
                v[i] = f;
            }
            if (ROTATE) warp_fwht<D>(v, lane);
#pragma unroll
            for (int i = 0; i < D / 32; i++) tile[r * D + i * 32 + lane] = v[i];
        }
        __syncthreads();
        // Two sub-vectors per group share every centroid read from shared memory. The bounds are
        // the same for every thread (the shuffles need whole warps); pairs past the tile compute
        // on its first and write nothing.
        const int items = rows * M;
        for (int base = 0; base < items; base += 2 * groups) {
            const int p0 = base + grp, p1 = p0 + groups;
            const bool one = p0 < items, two = p1 < items;
            const int q0 = one ? p0 : 0, q1 = two ? p1 : q0;
            const int j0 = q0 % M, j1 = q1 % M;
            float xa[SD], xb[SD];
#pragma unroll
            for (int d = 0; d < SD; d++) {
                xa[d] = tile[(q0 / M) * D + j0 * SD + d];
                xb[d] = tile[(q1 / M) * D + j1 * SD + d];
            }
            float best0 = 3.402823466e38f, best1 = 3.402823466e38f;
            int bi0 = sl, bi1 = sl;
            const float* c0 = BOOKS == 1 ? cb : cb + j0 * K * SD;
            const float* c1 = BOOKS == 1 ? cb : cb + j1 * K * SD;
            const float* n0 = BOOKS == 1 ? nb : nb + j0 * K;
            const float* n1 = BOOKS == 1 ? nb : nb + j1 * K;
            // Alone, a thread scans the book in order (a loop the compiler unrolls with fixed
            // offsets); in a group, interleaved (k = sl, sl + slices, …): the group's lanes read
            // neighbouring centroids, whole 16-byte rows (two wavefronts a warp at 16 lanes).
#if GRID
            if (grid_on) {
                grid_search(xa, c0, n0, goff, gent, box, sl, slices, best0, bi0);
                grid_search(xb, c1, n1, goff, gent, box, sl, slices, best1, bi1);
            } else
#endif
            if (slices == 1) {
                search<1>(xa, xb, c0, c1, n0, n1, 0, best0, bi0, best1, bi1);
            } else {
                search<0>(xa, xb, c0, c1, n0, n1, sl, best0, bi0, best1, bi1, slices);
            }
            for (int s = slices >> 1; s > 0; s >>= 1) {
                const float e0 = __shfl_xor_sync(FULL_MASK, best0, s), e1 = __shfl_xor_sync(FULL_MASK, best1, s);
                const int i0 = __shfl_xor_sync(FULL_MASK, bi0, s), i1 = __shfl_xor_sync(FULL_MASK, bi1, s);
                nearer(best0, bi0, e0, i0);
                nearer(best1, bi1, e1, i1);
            }
            if (sl == 0) {
                if (BITS == 8) {
                    if (one) out[map.out_row(row0 + p0 / M) * M + j0] = (unsigned char)bi0;
                    if (two) out[map.out_row(row0 + p1 / M) * M + j1] = (unsigned char)bi1;
                } else {
                    if (one) codes[p0] = (unsigned short)bi0;
                    if (two) codes[p1] = (unsigned short)bi1;
                }
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
