"""The codec and the cache over NumPy arrays, against exact references: codes that decode to
what the cache attends over, and attention equal to softmax attention over those vectors."""

import os

import numpy as np
import pytest

import veloq


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def cal(calibration_path):
    return veloq.Calibration.load(calibration_path)


def keys_like(rng, cal, tokens):
    """Random vectors at the scale of real keys (the codebooks' own spread)."""
    return (rng.standard_normal((tokens, cal.kv_heads, cal.head_dim)) * 2.0).astype(np.float32)


def test_calibration_describes_itself(cal):
    assert (cal.layers, cal.kv_heads, cal.head_dim, cal.method) == (30, 3, 64, "vq-4")
    assert 4.0 < cal.bits_per_element(4096) < 4.5
    assert cal.bits_per_element(1 << 20) < cal.bits_per_element(1024), "codebooks amortise"


def test_codes_are_four_bits_and_decode_to_the_nearest_reconstruction(cal, rng):
    x = keys_like(rng, cal, 40)
    codes = cal.quantize(3, "keys", x)
    assert codes.dtype == np.uint8 and codes.shape == (40 * 3 * 64 * 4 // 8,)
    y = cal.dequantize(3, "keys", codes)
    assert y.shape == x.shape and y.dtype == np.float32
    # A reconstruction is a fixed point of the codec: coding it again gives the same codes.
    assert np.array_equal(cal.quantize(3, "keys", y), codes)
    # And it is no worse than the reconstruction of any other token's codes (the search is an argmin).
    err = ((x - y) ** 2).sum(axis=(1, 2))
    shuffled = cal.dequantize(3, "keys", cal.quantize(3, "keys", x[::-1].copy()))[::-1]
    assert (err <= ((x - shuffled) ** 2).sum(axis=(1, 2)) + 1e-3).all()


def test_codec_input_is_checked(cal, rng):
    with pytest.raises(veloq.ShapeError, match="expected shape"):
        cal.quantize(0, "keys", np.zeros((4, 2, 64), np.float32))
    with pytest.raises(veloq.ConfigError, match="layer 30"):
        cal.quantize(30, "keys", keys_like(rng, cal, 2))
    with pytest.raises(veloq.ConfigError, match="side"):
        cal.quantize(0, "queries", keys_like(rng, cal, 2))
    with pytest.raises(veloq.ShapeError, match="whole number"):
        cal.dequantize(0, "values", np.zeros(7, np.uint8))


def reference(q, k, v, scale):
    """Causal softmax attention, GQA, in float64: q [t, hq, d] for the last t of n positions."""
    t, hq, _ = q.shape
    n, hk, _ = k.shape
    out = np.zeros(q.shape)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].astype(np.float64), v[:, h // (hq // hk)].astype(np.float64)
        for i in range(t):
            s = kh[: n - t + i + 1] @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vh[: n - t + i + 1] / p.sum()
    return out


def f16(x):
    return x.astype(np.float16).astype(np.float32)


def test_kv_cache_attends_over_codes_as_softmax_over_their_reconstructions(cal, rng):
    cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512)
    layer, n, scale = 5, 200, 0.125
    k, v = keys_like(rng, cal, n + 1), keys_like(rng, cal, n + 1)
    q = rng.standard_normal((n + 1, 9, 64)).astype(np.float32)
    # A prefill step attends over its own rows (f16): exact softmax attention up to f16 rounding.
    y = cache.attend(layer, q[None, :n], k[None, :n], v[None, :n], scale)[0]
    assert np.abs(y - reference(q[:n], f16(k[:n]), f16(v[:n]), scale)).max() < 1e-4
    assert cache.length(layer) == n and cache.length(0) == 0
    # The next step attends over what the prefill left: the oldest positions as codes (their
    # reconstructions), the first (sinks) and the most recent as f16 rows. Which boundary the
    # residency chose is found, not assumed; it must code most of the sequence.
    y = cache.attend(layer, q[None, n:], k[None, n:], v[None, n:], scale)[0]
    # Rows are kept in f16 until they are coded, so the codes are of the f16 rows.
    kq = cal.dequantize(layer, "keys", cal.quantize(layer, "keys", f16(k)))
    vq = cal.dequantize(layer, "values", cal.quantize(layer, "values", f16(v)))
    errors = {}
    for sink in (0, 1, 2, 4, 8):
        for end in range(sink, n + 1):
            kk, vv = f16(k).copy(), f16(v).copy()
            kk[sink:end], vv[sink:end] = kq[sink:end], vq[sink:end]
            errors[(sink, end)] = np.abs(y - reference(q[n:], kk, vv, scale)).max()
    (sink, end), best = min(errors.items(), key=lambda e: e[1])
    assert best < 1e-4, (sink, end, best)
    assert end - sink > n * 3 // 4, f"only {end - sink} of {n} positions coded"
    assert errors[(0, 0)] > 100 * best, "codes and f16 rows are told apart"


def test_kv_cache_holds_fewer_bytes_than_fp16(cal, rng):
    n = 1024
    coded = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=n)
    dense = veloq.KvCache("fp16", q_heads=9, layers=30, kv_heads=3, head_dim=64, max_context=n)
    empty = coded.resident_bytes
    for layer in range(30):
        k, v = keys_like(rng, cal, n), keys_like(rng, cal, n)
        q = rng.standard_normal((1, n, 9, 64)).astype(np.float32)
        coded.attend(layer, q, k[None], v[None])
        dense.attend(layer, q, k[None], v[None])
    fp16 = n * 30 * 3 * 64 * 2 * 2
    assert dense.resident_bytes >= fp16
    # Codes at 4 bits are a quarter of f16; the tables, sinks and recent rows come on top.
    assert coded.resident_bytes - empty < fp16 / 3.5, (coded.resident_bytes, empty, fp16)
    coded.truncate(0)
    assert coded.length(7) == 0 and coded.resident_bytes == empty


def test_kv_cache_input_is_checked(cal, rng):
    with pytest.raises(veloq.ConfigError, match="multiple"):
        veloq.KvCache("vq-4", q_heads=8, calibration=cal)
    with pytest.raises(veloq.ConfigError, match="layers, kv_heads and head_dim"):
        veloq.KvCache("fp16", q_heads=9)
    with pytest.raises(veloq.CalibrationError):
        veloq.KvCache("vq-4", q_heads=9, layers=30, kv_heads=3, head_dim=64)
    with pytest.raises(veloq.CalibrationError, match="head_dim"):
        veloq.KvCache("vq-4", q_heads=9, calibration=cal, head_dim=128)
    cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=16)
    k = keys_like(rng, cal, 4)[None]
    q = rng.standard_normal((1, 4, 9, 64)).astype(np.float32)
    with pytest.raises(veloq.ShapeError, match="q"):
        cache.attend(0, q[:, :, :3], k, k)
    with pytest.raises(veloq.ContextOverflowError):
        cache.attend(0, np.repeat(q, 5, axis=1), np.repeat(k, 5, axis=1), np.repeat(k, 5, axis=1))
    assert cache.length(0) == 0, "a refused step changes nothing"


def test_kv_cache_on_its_own_threads_attends_as_on_the_shared_pool(cal, rng):
    """`threads` changes where the kernels run (and so the order of some sums), nothing else: a
    prompt then decode steps agree within f32 summation error (a wrong result is off by O(1))."""
    caches = [veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512, threads=t) for t in (None, 1, 3)]
    for n in (300, 1, 1, 1):
        q = rng.standard_normal((1, n, 9, 64)).astype(np.float32)
        k, v = keys_like(rng, cal, n)[None], keys_like(rng, cal, n)[None]
        ref, *others = [c.attend(2, q, k, v, 0.125) for c in caches]
        for y in others:
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max() * 64
    assert {c.length(2) for c in caches} == {303}
    with pytest.raises(veloq.ConfigError, match="at least 1"):
        veloq.KvCache("vq-4", q_heads=9, calibration=cal, threads=0)
    with pytest.raises(veloq.ConfigError, match="CPU"):
        veloq.KvCache("vq-4", q_heads=9, calibration=cal, device="cuda", threads=2)


def test_append_stores_what_attend_stores(cal, rng):
    """A prompt appended without attention (the caller attended it) leaves the cache exactly as
    attending it does: the next step's attention is identical."""
    n, scale = 300, 0.125
    k, v = keys_like(rng, cal, n + 1)[None], keys_like(rng, cal, n + 1)[None]
    q = rng.standard_normal((1, n + 1, 9, 64)).astype(np.float32)
    attended = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512)
    appended = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512)
    attended.attend(3, q[:, :n], k[:, :n], v[:, :n], scale)
    appended.append(3, k[:, :n], v[:, :n])
    assert appended.length(3) == attended.length(3) == n
    assert appended.resident_bytes == attended.resident_bytes
    a = attended.attend(3, q[:, n:], k[:, n:], v[:, n:], scale)
    b = appended.attend(3, q[:, n:], k[:, n:], v[:, n:], scale)
    assert np.array_equal(a, b)
    # …and differs from a cache that holds something else.
    other = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512)
    other.append(3, k[:, 1 : n + 1], v[:, 1 : n + 1])
    assert not np.array_equal(a, other.attend(3, q[:, n:], k[:, n:], v[:, n:], scale))


def test_heads_first_arrays_attend_as_tokens_first_ones(cal, rng):
    """`heads_first` takes q, k, v as transformers holds them ([batch, heads, tokens, dim]): a
    transposed view of [batch, tokens, heads, dim] memory (read in place) and a contiguous
    heads-first copy (reordered) give bit for bit what the same values give tokens first."""
    caches = [veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=512, batch=2) for _ in range(3)]
    for n in (40, 1, 1, 7):
        q = rng.standard_normal((2, n, 9, 64)).astype(np.float32)
        k, v = (np.stack([keys_like(rng, cal, n) for _ in range(2)]) for _ in range(2))
        views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
        assert not views[0].flags.c_contiguous or n == 1
        ref = caches[0].attend(5, q, k, v, 0.125)
        got_view = caches[1].attend(5, *views, 0.125, heads_first=True)
        got_copy = caches[2].attend(5, *(np.ascontiguousarray(x) for x in views), 0.125, heads_first=True)
        assert ref.shape == got_view.shape == got_copy.shape == (2, n, 9, 64)
        assert np.array_equal(ref, got_view) and np.array_equal(ref, got_copy)
    k = np.stack([keys_like(rng, cal, 4) for _ in range(2)])
    caches[1].append(5, k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), heads_first=True)
    caches[0].append(5, k, k)
    assert caches[1].length(5) == caches[0].length(5) == 53
    with pytest.raises(veloq.ShapeError, match="k: expected shape"):
        caches[1].append(5, k, k, heads_first=True)  # tokens first, read as heads first


def test_skip_leaves_left_padding_out(cal, rng):
    """`append(skip=...)` holds each sequence without its first `skip` tokens (a left-padded
    batch): the next decode step attends as caches fed the unpadded sequences one by one."""
    width, skip = 50, [7, 0, 50]
    k, v = (np.stack([keys_like(rng, cal, width) for _ in range(3)]) for _ in range(2))
    batch = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=256, batch=3)
    batch.append(4, k, v, skip=skip)
    assert [batch.length(4, s) for s in range(3)] == [43, 50, 0]
    q = rng.standard_normal((3, 1, 9, 64)).astype(np.float32)
    k1, v1 = (np.stack([keys_like(rng, cal, 1) for _ in range(3)]) for _ in range(2))
    got = batch.attend(4, q, k1, v1, 0.125)
    for s in range(3):
        alone = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=256)
        if skip[s] < width:
            alone.append(4, k[s : s + 1, skip[s] :], v[s : s + 1, skip[s] :])
        want = alone.attend(4, q[s : s + 1], k1[s : s + 1], v1[s : s + 1], 0.125)
        # The same codes and rows summed in another order (a ragged batch against one sequence
        # split into position shares): softmax-weighted averages of n values differ in f32 by at
        # most about 2·n·ε·max|v| (ε f32's epsilon; the codes' reconstructions kept within twice
        # the values' range), whatever the CPU's vector width.
        n = width + 1
        bound = 2 * (n + 2) * np.finfo(np.float32).eps * 2 * max(np.abs(v).max(), np.abs(v1).max())
        assert np.abs(got[s] - want[0]).max() <= bound
    for bad in ([1, 2], [0, 0, 51]):
        with pytest.raises(veloq.ShapeError, match="skip"):
            batch.append(4, k, v, skip=bad)
    assert [batch.length(4, s) for s in range(3)] == [44, 51, 1], "a refused step changes nothing"


@pytest.mark.parametrize("method", ["fp16", "vq-4"])
def test_a_rollback_of_one_layer_and_sequence(cal, rng, method):
    """`truncate(length, layer=, seq=)` takes one sequence of one layer back; fed its positions
    again (`skip` for the other), the next step attends as a cache that never went back: exactly
    with f16 rows, within the codec's error where codes were decoded back into the window."""
    spec = dict(q_heads=9, max_context=512, batch=2)
    spec.update(calibration=cal) if method != "fp16" else spec.update(layers=30, kv_heads=3, head_dim=64)
    k, v = (np.stack([keys_like(rng, cal, 300) for _ in range(2)]) for _ in range(2))
    kept, cut = veloq.KvCache(method, **spec), veloq.KvCache(method, **spec)
    for c in (kept, cut):
        c.append(4, k, v)
        c.append(5, k, v)
    cut.truncate(250, layer=5, seq=1)
    assert [cut.length(5, s) for s in (0, 1)] == [300, 250] and cut.length(4, 1) == 300
    cut.append(5, np.ascontiguousarray(k[:, 250:]), np.ascontiguousarray(v[:, 250:]), skip=[50, 0])
    q = rng.standard_normal((2, 1, 9, 64)).astype(np.float32)
    k1, v1 = keys_like(rng, cal, 2)[:, None], keys_like(rng, cal, 2)[:, None]
    want, got = kept.attend(5, q, k1, v1, 0.125), cut.attend(5, q, k1, v1, 0.125)
    if method == "fp16":
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    with pytest.raises(veloq.ConfigError, match="layer 30"):
        cut.truncate(10, layer=30)


class FakeCudaArray:
    """Publishes a CUDA array interface without any memory behind it: only what is checked before
    a device is touched may be exercised with it."""

    def __init__(self, shape, typestr="<f4", strides=None, readonly=False):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (1 << 40, readonly), "strides": strides, "version": 3,
        }


def test_cuda_arrays_are_checked_before_any_device_is_used(cal, rng):
    cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=64)
    k = keys_like(rng, cal, 4)[None]
    q = rng.standard_normal((1, 4, 9, 64)).astype(np.float32)
    with pytest.raises(veloq.ShapeError, match="float32 or float16"):
        cache.append(0, FakeCudaArray(k.shape, typestr="<f8"), FakeCudaArray(k.shape))
    with pytest.raises(veloq.ShapeError, match="contiguous"):
        cache.append(0, FakeCudaArray(k.shape, strides=(4 * 64 * 3 * 4, 4, 4 * 4 * 64, 4 * 4 * 3)), FakeCudaArray(k.shape))
    # Strides are in bytes: float16's contiguous strides are half float32's.
    with pytest.raises(veloq.ShapeError, match="contiguous"):
        cache.append(0, FakeCudaArray(k.shape, typestr="<f2", strides=(4 * 3 * 64 * 4, 3 * 64 * 4, 64 * 4, 4)), FakeCudaArray(k.shape))
    with pytest.raises(veloq.DeviceError, match='device="cuda"'):
        cache.append(0, FakeCudaArray(k.shape, typestr="<f2", strides=(4 * 3 * 64 * 2, 3 * 64 * 2, 64 * 2, 2)), FakeCudaArray(k.shape))
    with pytest.raises(veloq.ShapeError, match="k: expected shape"):
        cache.append(0, FakeCudaArray((1, 4, 2, 64)), FakeCudaArray(k.shape))
    with pytest.raises(veloq.DeviceError, match='device="cuda"'):
        cache.append(0, FakeCudaArray(k.shape), FakeCudaArray(k.shape))
    with pytest.raises(veloq.ShapeError, match="out="):
        cache.attend(0, q, k, k, out=np.empty_like(q))
    # Heads first: shapes read as [batch, heads, tokens, dim]; the memory must be tokens first.
    heads_first = (1, 3, 4, 64)
    view = (4 * 4 * 3 * 64, 4 * 64, 4 * 3 * 64, 4)
    with pytest.raises(veloq.DeviceError, match='device="cuda"'):
        cache.append(0, FakeCudaArray(heads_first, strides=view), FakeCudaArray(heads_first, strides=view), heads_first=True)
    with pytest.raises(veloq.ShapeError, match="transposed view"):
        cache.append(0, FakeCudaArray(heads_first), FakeCudaArray(heads_first), heads_first=True)
    with pytest.raises(veloq.ShapeError, match="k: expected shape"):
        cache.append(0, FakeCudaArray(k.shape), FakeCudaArray(k.shape), heads_first=True)
    assert cache.length(0) == 0, "a refused step changes nothing"


def test_a_cuda_cache_needs_a_cuda_build_or_device(cal):
    try:
        cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=64, device="cuda")
    except veloq.DeviceError as e:
        assert "CUDA" in str(e) or "cuda" in str(e)
    else:
        assert cache.device == "cuda:0"
    with pytest.raises(veloq.DeviceError, match="expected cpu, cuda"):
        veloq.KvCache("vq-4", q_heads=9, calibration=cal, device="gpu")
