// Appends t new positions of every stream (keys and values: rows src0 .. src0 + t of f32
// [streams][src_t][D]) to the f16 rows of a cache (w: keys [streams][W][D], then values the same,
// one plane apart): position i goes to sink row
// sink0 + i while i < n_sink, then to ring row sink_cap + (ring0 + i - n_sink) mod ring_cap. One
// launch for keys and values.
//
// Defines: D.

struct PutMap {
    int t, src_t, src0, n_sink, sink0, sink_cap, ring0, ring_cap;
};

extern "C" __global__ void vq_window_put(const float* __restrict__ k, const float* __restrict__ v, unsigned short* __restrict__ w,
                                          long long plane, int W, PutMap map) {
    unsigned short* wk = w;
    unsigned short* wv = w + plane;
    const int stream = blockIdx.x, i = blockIdx.y;
    const int row = i < map.n_sink ? map.sink0 + i : map.sink_cap + (map.ring0 + i - map.n_sink) % map.ring_cap;
    const size_t src = ((size_t)stream * map.src_t + map.src0 + i) * D, dst = ((size_t)stream * W + row) * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        wk[dst + e] = f2h(k[src + e]);
        wv[dst + e] = f2h(v[src + e]);
    }
}
