#!/usr/bin/env python3
"""Where the whole decode step's host time goes in transformers (issue 33), in place: the random
Llama-3.1-8B config (hf_cache.py's), caches filled with `--contexts` random positions, then steps
timed one by one. The one-layer micro-benchmark (hf_attend_host.py) found veloq's hand-over level
with DynamicCache + SDPA's, while whole steps came out about 2 ms slower; this measures the whole
step's parts where they run.

Variants at each context, in turn, `--rounds` times (each a median of `--steps` after 4 warm-ups):
- `dynamic`: DynamicCache + transformers' SDPA;
- `dynamic, no attention`: DynamicCache's update, attention replaced by a stub that returns an
  empty output (what the rest of the step costs the host beside DynamicCache);
- `veloq`: VeloqCache (vq-4) as shipped;
- `veloq, timed`: the same with every native `attend` call timed on the host (µs per call where it
  runs, against the micro-benchmark's);
- `veloq, no native`: VeloqCache's Python path with the native call replaced by a stub.
- `dynamic, flash` / `dynamic, efficient` / `dynamic, cudnn`: DynamicCache + SDPA with torch's
  backend forced (`torch.nn.attention.sdpa_kernel`);
- `dynamic, lengths seen`: DynamicCache + SDPA over lengths it has attended before (the cache cut
  back to where the previous variant started): what a benchmark that refills a cache to the same
  context measures on its second pass.
Per step: wall (synchronised) and host (until the forward returns). Then each of `dynamic` and
`veloq` under cProfile for `--steps` steps: the Python functions and builtins by own time.

Usage: hf_host_split.py [--contexts 32768,131072] [--steps 16] [--rounds 2] [--json OUT]
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache

import veloq.transformers as vt
from hf_cache import fill, forward, llama8b, log, set_attn


def empty_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that attends nothing: transformers' output layout, uninitialised."""
    b, h, t, d = query.shape
    return torch.empty(b, t, h, d, dtype=query.dtype, device=query.device), None


AttentionInterface.register("empty", empty_attention)


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
VARIANTS = ("dynamic", "dynamic, lengths seen", "dynamic, flash", "dynamic, efficient", "dynamic, cudnn",
            "dynamic, no attention", "veloq", "veloq, timed", "veloq, no native")


def sdpa_choice(g, ctx):
    """The backend torch picks for a decode step's SDPA at `ctx` (transformers passes enable_gqa)."""
    try:
        q = torch.randn(1, g["q_heads"], 1, g["head_dim"], device="cuda", dtype=torch.float16)
        k = torch.randn(1, g["kv_heads"], ctx, g["head_dim"], device="cuda", dtype=torch.float16)
        return str(SDPBackend(torch._fused_sdp_choice(q, k, k, None, 0.0, False, enable_gqa=True)))
    except Exception as e:  # a private API: say so rather than fail the run
        return f"unknown ({e})"


def cut(cache, n):
    """DynamicCache back to its first `n` positions (by hand: `crop`'s argument changed meaning
    between transformers releases)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


class Native:
    """A VeloqCache's native cache with its `attend` timed on the host, or not run at all."""

    def __init__(self, native, run=True):
        self.native, self.run, self.calls, self.secs = native, run, 0, 0.0

    def attend(self, *a, **k):
        t = time.perf_counter()
        # The stub returns what a CUDA call returns (its out=), or the query's shape on the host.
        r = self.native.attend(*a, **k) if self.run else k.get("out", a[1])
        self.secs += time.perf_counter() - t
        self.calls += 1
        return r

    def __getattr__(self, name):
        return getattr(self.native, name)


def steps(model, cache, n, warmup=4):
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    wall, host = [], []
    with torch.no_grad():
        for i in range(warmup + n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = forward(model, ids, cache)
            h = time.perf_counter()
            nxt = int(out.logits[0, -1].argmax())
            w = time.perf_counter()
            del out
            if i >= warmup:
                wall.append(1e3 * (w - t))
                host.append(1e3 * (h - t))
            ids = torch.tensor([[nxt]], device=model.device)
    return statistics.median(wall), statistics.median(host)


def profiled(model, cache, n):
    prof = cProfile.Profile()
    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(n):
            out = forward(model, ids, cache)
            ids = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--json")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    model = llama8b(max(contexts) + 256)
    g = vt.geometry(model)
    ids = torch.randint(0, model.config.vocab_size, (a.calib_tokens,), generator=torch.Generator().manual_seed(0))
    cal = vt.calibrate(model, None, ids, method="vq-4", tokens=a.calib_tokens)
    log("model and calibration ready")
    res = {"contexts": {}}
    for ctx in contexts:
        log(f"ctx {ctx}: torch's SDPA backend for a decode step: {sdpa_choice(g, ctx)}")
        dyn = DynamicCache(config=model.config)
        fill(dyn, g, ctx, torch.Generator(device="cuda").manual_seed(1))
        vq = vt.VeloqCache(model, cal, max_context=ctx + 256)
        fill(vq, g, ctx, torch.Generator(device="cuda").manual_seed(1))
        real = vq.native
        rows = {}
        for r in range(a.rounds):
            for name in VARIANTS:
                timed, backend = None, contextlib.nullcontext()
                if name.startswith("dynamic"):
                    set_attn(model, "empty" if name == "dynamic, no attention" else "sdpa")
                    cache = dyn
                    forced = name.split(", ")[-1]
                    if forced in BACKENDS:
                        backend = sdpa_kernel(BACKENDS[forced])
                    if name == "dynamic, lengths seen":
                        cut(dyn, seen)
                    seen = dyn.get_seq_length()
                else:
                    set_attn(model, "veloq")
                    vq.native = real if name == "veloq" else Native(real, run=name == "veloq, timed")
                    timed, cache = vq.native, vq
                try:
                    with backend:
                        wall, host = steps(model, cache, a.steps)
                except RuntimeError as e:
                    log(f"ctx {ctx} round {r + 1} {name:>22}: {str(e).splitlines()[0]}")
                    continue
                row = rows.setdefault(name, {"wall_ms": [], "host_ms": [], "native_us": []})
                row["wall_ms"].append(wall)
                row["host_ms"].append(host)
                extra = ""
                if isinstance(timed, Native) and timed.run and timed.calls:
                    row["native_us"].append(1e6 * timed.secs / timed.calls)
                    extra = f", native attend {row['native_us'][-1]:.1f} us/call over {timed.calls} calls"
                log(f"ctx {ctx} round {r + 1} {name:>22}: wall {wall:6.2f} ms, host {host:6.2f} ms{extra}")
        vq.native = real
        set_attn(model, "sdpa")
        prof_dyn = profiled(model, dyn, a.steps)
        set_attn(model, "veloq")
        prof_vq = profiled(model, vq, a.steps)
        print(f"\n== cProfile, ctx {ctx}, DynamicCache + SDPA, {a.steps} steps\n{prof_dyn}")
        print(f"\n== cProfile, ctx {ctx}, VeloqCache, {a.steps} steps\n{prof_vq}", flush=True)
        res["contexts"][ctx] = {"rows": rows, "profile_dynamic": prof_dyn, "profile_veloq": prof_vq}
        del dyn, vq, real
        torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
