"""The cache on a CUDA device from torch: CUDA tensors handed to veloq by device address and
ordered on torch's streams. Skipped without a GPU, or in a veloq built without CUDA (CI has
neither; scripts/device/hf_cache.sh runs them on the H200)."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import veloq  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    veloq.KvCache("fp16", q_heads=2, layers=1, kv_heads=1, head_dim=64, max_context=8, device="cuda")
except veloq.DeviceError as e:
    pytest.skip(f"veloq without CUDA: {e}", allow_module_level=True)


@pytest.fixture(scope="module")
def calibration_path(tmp_path_factory):
    """A vq-4 calibration of a model of SmolLM2's head geometry (30 layers, 3 kv heads, head_dim
    64) trained on random vectors: self-contained, so the device needs no model file."""
    rng = np.random.default_rng(0)
    keys = [(rng.standard_normal((600, 3, 64)) * 2).astype(np.float32) for _ in range(30)]
    values = [(rng.standard_normal((600, 3, 64)) * 2).astype(np.float32) for _ in range(30)]
    out = tmp_path_factory.mktemp("cal") / "random.vq-4.safetensors"
    veloq.Calibration.train(keys, values, method="vq-4").save(out)
    return out


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def steps(gen, hq, hk, d, lengths):
    """Random prefill-then-decode steps: [(q, k, v)] as float32 CUDA tensors [1, t, heads, d]."""
    out = []
    for t in lengths:
        q = torch.randn(1, t, hq, d, device="cuda", generator=gen)
        k = torch.randn(1, t, hk, d, device="cuda", generator=gen) * 2
        v = torch.randn(1, t, hk, d, device="cuda", generator=gen) * 2
        out.append((q, k, v))
    return out


@pytest.mark.parametrize("method", ["fp16", "vq-4"])
def test_cuda_tensors_give_what_host_arrays_give(calibration_path, gen, method):
    """The same steps through CUDA tensors (device addresses, torch's stream) and through NumPy
    arrays into another cache on the same device: the same kernels, so identical attention."""
    cal = veloq.Calibration.load(calibration_path) if method != "fp16" else None
    spec = dict(q_heads=9, calibration=cal, max_context=1024, device="cuda")
    if cal is None:
        spec.update(layers=30, kv_heads=3, head_dim=64)
    a, b = veloq.KvCache(method, **spec), veloq.KvCache(method, **spec)
    stream = torch.cuda.current_stream().cuda_stream
    for q, k, v in steps(gen, 9, 3, 64, [300, 1, 1, 40, 1]):
        out = torch.empty_like(q)
        y = a.attend(2, q, k, v, 0.125, out=out, stream=stream)
        assert y is out
        ref = b.attend(2, q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), 0.125)
        assert np.array_equal(out.cpu().numpy(), ref)
    assert a.length(2) == b.length(2) == 343
    assert a.resident_bytes == b.resident_bytes


def test_cuda_attention_matches_the_cpu_cache(calibration_path, gen):
    """The CUDA kernels and the CPU kernels attend over the same codes: equal within f16/f32
    arithmetic (the codes and the rows are the same; the order of sums differs)."""
    cal = veloq.Calibration.load(calibration_path)
    gpu = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024, device="cuda")
    cpu = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024)
    for q, k, v in steps(gen, 9, 3, 64, [500, 1, 1]):
        out = torch.empty_like(q)
        gpu.attend(7, q, k, v, out=out)
        ref = cpu.attend(7, q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy())
        scale = np.abs(ref).max()
        assert np.abs(out.cpu().numpy() - ref).max() < 2e-3 * scale


def test_work_is_ordered_on_a_side_stream(calibration_path, gen):
    """Inputs written by a kernel on a non-default stream and the output read there: veloq's
    stream waits for the writes and the side stream for veloq's, with no host synchronisation
    in between (an unordered read would see the buffers before the writes)."""
    cal = veloq.Calibration.load(calibration_path)
    cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=4096, device="cuda")
    ref = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=4096, device="cuda")
    side = torch.cuda.Stream()
    q0, k0, v0 = steps(gen, 9, 3, 64, [3000])[0]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # A long chain of kernels on the side stream before the inputs are final.
        q, k, v = torch.zeros_like(q0), torch.zeros_like(k0), torch.zeros_like(v0)
        for _ in range(50):
            q.mul_(0.5).add_(q0, alpha=0.5)
            k.mul_(0.5).add_(k0, alpha=0.5)
            v.mul_(0.5).add_(v0, alpha=0.5)
        out = torch.empty_like(q)
        cache.attend(0, q, k, v, out=out, stream=side.cuda_stream)
        got = (out * 1.0).cpu()  # read on the side stream, after veloq's writes
    torch.cuda.synchronize()
    want = torch.empty_like(q)
    ref.attend(0, q, k, v, out=want)
    torch.cuda.synchronize()
    assert torch.equal(got, want.cpu())


class _Interface:
    """A CUDA array known only by its ``__cuda_array_interface__`` (as CuPy or Numba hand one over)."""

    def __init__(self, t):
        self.t = t

    @property
    def __cuda_array_interface__(self):
        if self.t.dtype == torch.float64:
            return {**torch.zeros(1, device="cuda").__cuda_array_interface__, "typestr": "<f8"}
        return self.t.__cuda_array_interface__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["fp16", "vq-4"])
def test_half_tensors_are_converted_in_the_copy(calibration_path, gen, method, dtype):
    """A model's f16/bf16 tensors are read as they are, converted to f32 exactly in the copy, and
    the attention written back in the output's dtype: what the same values give as float32,
    rounded once (both round to nearest even). Mixed dtypes in one call too."""
    cal = veloq.Calibration.load(calibration_path) if method != "fp16" else None
    spec = dict(q_heads=9, calibration=cal, max_context=1024, device="cuda")
    if cal is None:
        spec.update(layers=30, kv_heads=3, head_dim=64)
    lo, ref = veloq.KvCache(method, **spec), veloq.KvCache(method, **spec)
    for i, (q, k, v) in enumerate(steps(gen, 9, 3, 64, [200, 1, 1, 30, 1])):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        want = torch.empty(q.shape, device="cuda")
        ref.attend(1, q.float(), k.float(), v.float(), out=want)
        if i == 3:  # mixed: f32 queries, f16/bf16 keys and values, f32 out
            got = torch.empty_like(want)
            lo.attend(1, q.float(), k, v, out=got)
            assert torch.equal(got, want)
        else:
            got = torch.empty_like(q)
            lo.attend(1, q, k, v, out=got)
            assert got.dtype == dtype
            assert torch.equal(got, want.to(dtype))
    assert lo.length(1) == ref.length(1) == 233


def test_array_interface_path_matches_torch_tensors(calibration_path, gen):
    """Arrays known only by ``__cuda_array_interface__`` (float32 and float16) give exactly what
    the same torch tensors give through their own attributes."""
    cal = veloq.Calibration.load(calibration_path)
    a = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024, device="cuda")
    b = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024, device="cuda")
    for i, (q, k, v) in enumerate(steps(gen, 9, 3, 64, [100, 1, 1])):
        if i == 2:
            q, k, v = q.half(), k.half(), v.half()
        ya, yb = torch.empty_like(q), torch.empty_like(q)
        a.attend(0, q, k, v, out=ya)
        b.attend(0, _Interface(q), _Interface(k), _Interface(v), out=_Interface(yb))
        assert torch.equal(ya, yb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_heads_first_tensors_are_read_in_place(calibration_path, gen, dtype):
    """transformers' q, k, v ([batch, heads, tokens, dim] views of tokens-first memory) given
    `heads_first` attend bit for bit as the same memory given tokens first, prompt and decode;
    heads-first memory (a model that made it contiguous) is refused, and veloq.transformers'
    call falls back to reordering it, again bit for bit."""
    import veloq.transformers as vt

    cal = veloq.Calibration.load(calibration_path)
    spec = dict(q_heads=9, calibration=cal, max_context=1024, device="cuda", batch=2)
    a, b, c = (veloq.KvCache("vq-4", **spec) for _ in range(3))
    for n in (120, 1, 1, 9, 1):
        q, k, v = (torch.randn(2, n, h, 64, device="cuda", generator=gen).to(dtype) for h in (9, 3, 3))
        want, got, back = (torch.empty_like(q) for _ in range(3))
        a.attend(6, q, k, v, out=want)
        b.attend(6, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out=got, heads_first=True)
        assert torch.equal(got, want)
        heads = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        if n > 1:
            with pytest.raises(veloq.ShapeError, match="transposed view"):
                c.attend(6, *heads, out=back, heads_first=True)
        vt._cuda_call(c.attend, 6, tensors=heads, out=back)
        assert torch.equal(back, want)
    assert a.length(6) == b.length(6) == c.length(6) == 132


@pytest.mark.parametrize("method", ["fp16", "vq-4"])
def test_skip_leaves_left_padding_out_on_cuda(calibration_path, gen, method):
    """A left-padded batch appended with `skip` (f16 tensors heads first, as transformers hands
    them) holds each sequence as caches fed the unpadded sequences one by one: the next step's
    attention agrees within f32 summation order (a ragged batch against single sequences)."""
    cal = veloq.Calibration.load(calibration_path) if method != "fp16" else None
    spec = dict(q_heads=9, calibration=cal, max_context=1024, device="cuda")
    if cal is None:
        spec.update(layers=30, kv_heads=3, head_dim=64)
    width, skip = 300, [37, 0, 299]
    k, v = (torch.randn(3, width, 3, 64, device="cuda", generator=gen).half() * 2 for _ in range(2))
    batch = veloq.KvCache(method, batch=3, **spec)
    batch.append(2, k.transpose(1, 2), v.transpose(1, 2), heads_first=True, skip=skip)
    assert [batch.length(2, s) for s in range(3)] == [263, 300, 1]
    q, k1, v1 = (torch.randn(3, 1, h, 64, device="cuda", generator=gen).half() for h in (9, 3, 3))
    got = torch.empty_like(q)
    batch.attend(2, q, k1, v1, out=got)
    for s in range(3):
        alone = veloq.KvCache(method, **spec)
        alone.append(2, k[s : s + 1, skip[s] :].contiguous(), v[s : s + 1, skip[s] :].contiguous())
        want = torch.empty_like(q[s : s + 1])
        alone.attend(2, q[s : s + 1], k1[s : s + 1], v1[s : s + 1], out=want)
        # Both outputs are f16 (each rounded to 2^-11 of its size) over f32 sums in different
        # orders: a few f16 steps of the largest output apart at most.
        assert (got[s].float() - want[0].float()).abs().max() <= 2e-3 * want.float().abs().max()


@pytest.mark.parametrize("method", ["fp16", "vq-4"])
def test_a_rollback_of_one_layer_and_sequence_on_cuda(calibration_path, gen, method):
    """`truncate(length, layer=, seq=)` (speculative decoding's rollback) takes one sequence of one
    layer back; fed its positions again (`skip` for the other), the next step attends as a cache
    that never went back: exactly with fp16 rows, within the codec's error with codes restored."""
    cal = veloq.Calibration.load(calibration_path) if method != "fp16" else None
    spec = dict(q_heads=9, calibration=cal, max_context=1024, device="cuda", batch=2)
    if cal is None:
        spec.update(layers=30, kv_heads=3, head_dim=64)
    k, v = (torch.randn(2, 300, 3, 64, device="cuda", generator=gen) * 2 for _ in range(2))
    kept, cut = veloq.KvCache(method, **spec), veloq.KvCache(method, **spec)
    for c in (kept, cut):
        c.append(4, k, v)
        c.append(5, k, v)
    cut.truncate(250, layer=5, seq=1)
    assert [cut.length(5, s) for s in (0, 1)] == [300, 250] and cut.length(4, 1) == 300
    cut.append(5, k[:, 250:].contiguous(), v[:, 250:].contiguous(), skip=[50, 0])
    assert [cut.length(5, s) for s in (0, 1)] == [300, 300]
    q, k1, v1 = (torch.randn(2, 1, h, 64, device="cuda", generator=gen) for h in (9, 3, 3))
    want, got = torch.empty_like(q), torch.empty_like(q)
    kept.attend(5, q, k1, v1, out=want)
    cut.attend(5, q, k1, v1, out=got)
    if method == "fp16":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    with pytest.raises(veloq.ConfigError, match="sequence 2"):
        cut.truncate(10, layer=5, seq=2)


def test_a_left_padded_batch_through_transformers_on_cuda():
    """A random two-layer Llama in f16 on the GPU, a left-padded batch of three prompts (5, 0 and
    31 pads of 40), then three teacher-forced steps: VeloqCache fp16 gives DynamicCache's logits
    within f16 rounding; attending the pads instead moves them by O(1) of their scale."""
    transformers = pytest.importorskip("transformers")
    import veloq.transformers as vt

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().half().eval()
    model.set_attn_implementation("veloq")
    ids = torch.randint(3, 1000, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :31] = 0
    ids[mask == 0] = 0
    ids, mask = ids.cuda(), mask.cuda()

    def run(cache, m):
        logits, x = [], ids
        with torch.no_grad():
            for step in range(4):
                out = model(input_ids=x, attention_mask=m, use_cache=True, **{vt._cache_kwarg(model): cache})
                logits.append(out.logits[:, -1].float())
                x = torch.full((3, 1), 7 + step, device="cuda")
                m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype, device="cuda")], dim=1)
        return torch.stack(logits)

    ref = run(transformers.DynamicCache(config=cfg), mask)
    cache = vt.VeloqCache(model, method="fp16", max_context=128)
    got = run(cache, mask)
    wrong = run(transformers.DynamicCache(config=cfg), torch.ones_like(mask))
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 1e-2 * scale
    assert (wrong - ref).abs().max() > 0.2 * scale
    assert [cache.native.length(1, s) for s in range(3)] == [38, 43, 12]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_tensors_on_another_gpu_are_refused(gen):
    cache = veloq.KvCache("fp16", q_heads=2, layers=1, kv_heads=1, head_dim=64, max_context=8, device="cuda:0")
    k = torch.randn(1, 1, 1, 64, device="cuda:1")
    with pytest.raises(veloq.DeviceError, match="cuda:1"):
        cache.append(0, k, k)


def test_append_then_decode_on_cuda(calibration_path, gen):
    cal = veloq.Calibration.load(calibration_path)
    a = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024, device="cuda")
    b = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=1024, device="cuda")
    (q, k, v), (q1, k1, v1) = steps(gen, 9, 3, 64, [600, 1])
    a.attend(4, q, k, v, out=torch.empty_like(q))
    b.append(4, k, v)
    ya, yb = torch.empty_like(q1), torch.empty_like(q1)
    a.attend(4, q1, k1, v1, out=ya)
    b.attend(4, q1, k1, v1, out=yb)
    assert torch.equal(ya, yb)


def test_misuse_on_cuda_is_refused(calibration_path, gen):
    cal = veloq.Calibration.load(calibration_path)
    cache = veloq.KvCache("vq-4", q_heads=9, calibration=cal, max_context=64, device="cuda")
    q, k, v = steps(gen, 9, 3, 64, [4])[0]
    with pytest.raises(veloq.ShapeError, match="out="):
        cache.attend(0, q, k, v)
    with pytest.raises(veloq.ShapeError, match="float32, float16 or bfloat16, got torch.float64"):
        cache.attend(0, q, k.double(), v, out=torch.empty_like(q))
    with pytest.raises(veloq.ShapeError, match="float32 or float16"):
        cache.attend(0, q, _Interface(k.double()), v, out=torch.empty_like(q))
    with pytest.raises(veloq.ShapeError, match="contiguous"):
        cache.attend(0, q, k.transpose(1, 2).contiguous().transpose(1, 2), v, out=torch.empty_like(q))
    with pytest.raises(veloq.ShapeError, match="CUDA array"):
        cache.attend(0, q, k, v.cpu(), out=torch.empty_like(q))
    with pytest.raises(veloq.ContextOverflowError):
        big = steps(gen, 9, 3, 64, [100])[0]
        cache.attend(0, *big, out=torch.empty_like(big[0]))
    assert cache.length(0) == 0, "a refused step changes nothing"
