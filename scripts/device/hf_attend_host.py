#!/usr/bin/env python3
"""Host time of one layer's attention hand-over in transformers (issue 33): eager decode of the 8B
config is bound by the host, so what a layer's attention costs the host is what a step pays.
One layer of the Llama-3.1-8B geometry (32 query heads, 8 kv heads, head dim 128, f16), a cache
of `--context` positions, then `--calls` one-token steps back to back with one synchronisation at
the end: wall time per call is host time only while the GPU keeps up, so the first `--host-calls`
are also timed as issued (before the synchronisation, and few enough that the GPU's launch queue
cannot fill and hold the host back). Variants, each on a fresh cache, alternated `--rounds` times:

- `dynamic+sdpa`: DynamicCache's layer update (two `cat`s) and transformers' SDPA attention;
- `dynamic+flash`: the same with torch's flash backend forced (`sdpa_kernel`, around the calls);
- `veloq reordered`: the previous hand-over — q, k, v reordered to [batch, tokens, heads, dim]
  by torch (detach, transpose, contiguous: three ops a tensor), then read by veloq;
- `veloq`: `vt.veloq_attention` as shipped (the model's f16 tensors read in place, heads first,
  through their own attributes, converted in veloq's copy; the output written in f16);
- `native only`: `KvCache.attend` alone on ready f16 tensors (veloq's own host time).

Usage: hf_attend_host.py [--context 1024] [--calls 400] [--rounds 3] [--json OUT]
"""
import argparse
import contextlib
import json
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaAttention

import veloq
import veloq.transformers as vt
from hf_models import llama8b_config

HQ, HK, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-calls", type=int, default=64,
                    help="calls timed as issued, before the GPU can hold the host back (its launch queue)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    cal = veloq.Calibration.train(
        [rng.standard_normal((1024, HK, D)).astype(np.float32)],
        [rng.standard_normal((1024, HK, D)).astype(np.float32)],
        method="vq-4",
    )
    cfg = llama8b_config(a.context + a.calls + 64)
    cfg._attn_implementation = "sdpa"
    module = LlamaAttention(cfg, layer_idx=0).cuda().half().eval()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(h, t):
        return torch.randn(1, h, t, D, device="cuda", dtype=torch.float16, generator=gen)

    steps = [(rand(HQ, 1), rand(HK, 1), rand(HK, 1)) for _ in range(a.calls)]
    scale = D**-0.5
    stream = torch.cuda.current_stream().cuda_stream

    def veloq_cache():
        c = veloq.KvCache("vq-4", q_heads=HQ, calibration=cal, max_context=a.context + a.calls + 64, device="cuda")
        c.append(0, vt._cuda_rows(rand(HK, a.context)), vt._cuda_rows(rand(HK, a.context)), stream=stream)
        return c

    def dynamic():
        cache = DynamicCache(config=cfg)
        cache.update(rand(HK, a.context), rand(HK, a.context), 0)
        attn = vt.ALL_ATTENTION_FUNCTIONS["sdpa"]

        def call(q, k, v):
            kk, vv = cache.update(k, v, 0)
            return attn(module, q, kk, vv, None, scaling=scale)[0]

        return call

    def reordered():
        c = veloq_cache()

        def call(q, k, v):
            qr = vt._cuda_rows(q)
            out = torch.empty(qr.shape, dtype=q.dtype, device=q.device)
            c.attend(0, qr, vt._cuda_rows(k), vt._cuda_rows(v), scale, out=out, stream=vt._stream(q.device))
            return out

        return call

    def shipped():
        owner = type("Owner", (), {})()
        owner.native = veloq_cache()
        layer = type("Layer", (), {"index": 0, "owner": owner, "is_sliding": False})()

        def call(q, k, v):
            vt._current.layer = layer
            return vt.veloq_attention(module, q, k, v, None, scaling=scale)[0]

        return call

    def native():
        c = veloq_cache()
        ready = [(vt._cuda_rows(q), vt._cuda_rows(k), vt._cuda_rows(v), torch.empty(1, 1, HQ, D, device="cuda", dtype=torch.float16)) for q, k, v in steps]
        it = iter(ready)

        def call(q, k, v):
            q, k, v, out = next(it)
            return c.attend(0, q, k, v, scale, out=out, stream=stream)

        return call

    variants = {"dynamic+sdpa": dynamic, "dynamic+flash": dynamic, "veloq reordered": reordered, "veloq": shipped,
                "native only": native}
    res = {"context": a.context, "calls": a.calls, "us_per_call": {k: [] for k in variants},
           "host_us_per_call": {k: [] for k in variants}}
    with torch.no_grad():
        for r in range(a.rounds):
            for name, make in variants.items():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "dynamic+flash" else contextlib.nullcontext():
                    call = make()
                    for q, k, v in steps[:20]:  # warm-up (also compiles veloq's kernels once)
                        call(q, k, v)
                    call = make()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    host, first = None, min(a.host_calls, a.calls)
                    for i, (q, k, v) in enumerate(steps):
                        call(q, k, v)
                        if i + 1 == first:
                            host = 1e6 * (time.perf_counter() - t) / first
                    torch.cuda.synchronize()
                    us = 1e6 * (time.perf_counter() - t) / a.calls
                    res["us_per_call"][name].append(us)
                    res["host_us_per_call"][name].append(host)
                    print(f"round {r + 1} {name:>15}: {us:7.1f} us/call, first {first} calls issued at {host:7.1f} us/call", flush=True)
    for key in ("us_per_call", "host_us_per_call"):
        print(f"median {key}:", {k: round(sorted(v)[len(v) // 2], 1) for k, v in res[key].items()})
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
