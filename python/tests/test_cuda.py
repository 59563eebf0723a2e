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
    with pytest.raises(veloq.ShapeError, match="float32"):
        cache.attend(0, q, k.half(), v, out=torch.empty_like(q))
    with pytest.raises(veloq.ShapeError, match="contiguous"):
        cache.attend(0, q, k.transpose(1, 2).contiguous().transpose(1, 2), v, out=torch.empty_like(q))
    with pytest.raises(veloq.ShapeError, match="CUDA array"):
        cache.attend(0, q, k, v.cpu(), out=torch.empty_like(q))
    with pytest.raises(veloq.ContextOverflowError):
        big = steps(gen, 9, 3, 64, [100])[0]
        cache.attend(0, *big, out=torch.empty_like(big[0]))
    assert cache.length(0) == 0, "a refused step changes nothing"
