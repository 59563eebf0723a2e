#!/usr/bin/env python3
"""Where a decode step's host time goes in transformers (issue 33): the random Llama-3.1-8B config
(hf_cache.py's), a cache filled with `--context` random positions, then `--steps` decode steps
under torch.profiler (CPU activity, the host's time per op and per Python call; with `--cuda` also
CUPTI's record of every CUDA driver and runtime call the process makes — veloq's own included — and
the kernels' device time), for each of `--kinds` (DynamicCache + SDPA as transformers picks it,
the same with flash forced, VeloqCache vq-4) in turn, twice; prints each one's step time and its
top ops by self CPU time.

Usage: hf_profile.py [--context 8192] [--steps 8] [--kinds dynamic-sdpa,veloq] [--cuda] [--json OUT]
"""
import argparse
import contextlib
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import veloq.transformers as vt
from hf_cache import fill, llama8b, set_attn, time_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kinds", default="dynamic-sdpa,veloq", help="dynamic-sdpa, dynamic-flash, veloq")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--cuda", action="store_true", help="also record CUDA API calls and kernels (CUPTI)")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = llama8b(a.context + 64)
    g = vt.geometry(model)
    kinds = a.kinds.split(",")
    cal = None
    if "veloq" in kinds:
        ids = torch.randint(0, 128256, (a.calib_tokens,), generator=torch.Generator().manual_seed(0))
        cal = vt.calibrate(model, None, ids, method="vq-4", tokens=a.calib_tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    res = {"context": a.context, "runs": []}
    for kind in kinds * 2:
        set_attn(model, "veloq" if kind == "veloq" else "sdpa")
        cache = vt.VeloqCache(model, cal, max_context=a.context + 64) if kind == "veloq" else DynamicCache(config=model.config)
        fill(cache, g, a.context, torch.Generator(device="cuda").manual_seed(1))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if kind == "dynamic-flash" else contextlib.nullcontext():
            time_steps(model, cache, 4, 0)
            with profile(activities=activities) as prof:
                t = time_steps(model, cache, a.steps, 0)
        ms = 1e3 * sorted(t)[len(t) // 2]
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(f"\n== {kind}: median step {ms:.2f} ms under the profiler ({a.steps} steps)\n{table}", flush=True)
        res["runs"].append({"cache": kind, "median_ms": ms, "table": table})
        del cache
        torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
