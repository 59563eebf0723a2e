#!/usr/bin/env python3
"""Where a decode step's host time goes in transformers (issue 33): the random Llama-3.1-8B config
(hf_cache.py's), a cache filled with `--context` random positions, then `--steps` decode steps
under torch.profiler (CPU activity, the host's time per op and per Python call), for DynamicCache
+ SDPA and for VeloqCache (vq-4), one after the other; prints each one's step time and its top ops
by self CPU time.

Usage: hf_profile.py [--context 8192] [--steps 8] [--json OUT]
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import veloq.transformers as vt
from hf_cache import fill, llama8b, set_attn, time_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = llama8b(a.context + 64)
    g = vt.geometry(model)
    ids = torch.randint(0, 128256, (2048,), generator=torch.Generator().manual_seed(0))
    cal = vt.calibrate(model, None, ids, method="vq-4", tokens=2048)
    res = {"context": a.context, "runs": []}
    for kind in ("dynamic-sdpa", "veloq", "dynamic-sdpa", "veloq"):
        set_attn(model, "sdpa" if kind == "dynamic-sdpa" else "veloq")
        cache = DynamicCache(config=model.config) if kind == "dynamic-sdpa" else vt.VeloqCache(model, cal, max_context=a.context + 64)
        fill(cache, g, a.context, torch.Generator(device="cuda").manual_seed(1))
        time_steps(model, cache, 4, 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time_steps(model, cache, a.steps, 0)
        ms = 1e3 * sorted(t)[len(t) // 2]
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
        print(f"\n== {kind}: median step {ms:.2f} ms under the profiler\n{table}", flush=True)
        res["runs"].append({"cache": kind, "median_ms": ms, "table": table})
        del cache
        torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
