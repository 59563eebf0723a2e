// Appends t new positions of every stream (stream = sequence b, kv head h) to the f16 rows of a
// cache (w: keys [streams][W][D], then values the same, one plane apart). The source is a step's
// packed keys and values, f32 token-major [tokens][heads][D]: sequence b's rows start at token
// src0 + b·src_t. Position i goes to sink row sink0 + i while i < n_sink, then to ring row
// sink_cap + (ring0 + i - n_sink) mod ring_cap. One launch for keys and values.
//
// Defines: D.

struct PutMap {
    int t, src_t, src0, heads, n_sink, sink0, sink_cap, ring0, ring_cap;
};

extern "C" __global__ void vq_window_put(const float* __restrict__ k, const float* __restrict__ v, unsigned short* __restrict__ w,
                                          long long plane, int W, PutMap map) {
    grid_launch_dependents();  // the attention after it scores codes meanwhile (launch.rs)
    unsigned short* wk = w;
    unsigned short* wv = w + plane;
    const int stream = blockIdx.x, i = blockIdx.y;
    const int row = i < map.n_sink ? map.sink0 + i : map.sink_cap + (map.ring0 + i - map.n_sink) % map.ring_cap;
    const int b = stream / map.heads, h = stream % map.heads;
    const size_t src = (((size_t)map.src0 + (size_t)b * map.src_t + i) * map.heads + h) * D, dst = ((size_t)stream * W + row) * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        wk[dst + e] = f2h(k[src + e]);
        wv[dst + e] = f2h(v[src + e]);
    }
}

// One row of each of a ragged batch's sequences (a decode step's, every sequence at its own
// position): sequence b's table entry (3 ints) gives its slot, its packed input row and its
// destination row; stream (b, h) writes the row of kv head h of that slot. One launch for keys
// and values of every sequence.
extern "C" __global__ void vq_window_put_ragged(const float* __restrict__ k, const float* __restrict__ v,
                                                 unsigned short* __restrict__ w, long long plane, int W, int heads,
                                                 const int* __restrict__ table) {
    grid_launch_dependents();
    const int stream = blockIdx.x, b = stream / heads, h = stream % heads;
    const int slot = table[3 * b], src_row = table[3 * b + 1], row = table[3 * b + 2];
    const size_t src = ((size_t)src_row * heads + h) * D, dst = (((size_t)slot * heads + h) * W + row) * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        w[dst + e] = f2h(k[src + e]);
        w[plane + dst + e] = f2h(v[src + e]);
    }
}
