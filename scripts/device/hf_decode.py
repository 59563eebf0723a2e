#!/usr/bin/env python3
"""The anchor of `veloq bench runner`'s 8B decode, run in the same device call: Hugging Face
transformers with a random-weight Llama-3.1-8B config (what the runner's `llama8b` is), a static
cache sized to each context, and `torch.compile(mode="reduce-overhead")` (CUDA graphs), the setup
transformers documents for fast decode. One token per sequence per step, greedy argmax read back to
the host each step as in generation; median step time after warm-up (compiles excluded).

A static cache attends over its whole length with a mask, so a step costs what its cache size
costs whatever was written into it: decoding from position `context` in a cache of `context +
steps` positions times what a user at that context sees, without prefilling it.

Usage: hf_decode.py --json OUT [--contexts 1024,8192,32768,131072] [--batches 1,8] [--budget-s 330]
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import StaticCache

from hf_models import llama8b_config, random_model


def static_cache(cfg, batch, length, dtype):
    # The constructor's arguments changed across transformers versions.
    try:
        return StaticCache(config=cfg, max_batch_size=batch, max_cache_len=length, device="cuda", dtype=dtype)
    except TypeError:
        return StaticCache(config=cfg, max_cache_len=length)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no new case after this many seconds")
    a = ap.parse_args()
    t0 = time.time()
    dtype = getattr(torch, a.dtype)
    contexts = [int(c) for c in a.contexts.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    longest = max(contexts) + a.steps + a.warmup + 8
    cfg = llama8b_config(longest)
    model = random_model(cfg, dtype)
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, transformers {transformers.__version__}: "
          f"random Llama-3.1-8B config, {params / 1e9:.2f} B parameters, {a.dtype}, static cache, "
          f"torch.compile(mode='reduce-overhead')  [{time.time() - t0:.0f} s]", flush=True)
    step_fn = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    rows = []
    print(f"{'batch':>5} {'context':>7} | {'ms/step':>8} {'tok/s':>9} {'min':>7} {'max':>7} | first step (compile) s", flush=True)
    for batch in batches:
        for ctx in contexts:
            row = {"batch": batch, "context": ctx}
            if time.time() - t0 > a.budget_s:
                row["skipped"] = "time budget of the call"
                rows.append(row)
                print(f"{batch:>5} {ctx:>7} | skipped (time budget)", flush=True)
                continue
            try:
                cache = static_cache(cfg, batch, ctx + a.warmup + a.steps + 1, dtype)
                ids = torch.ones(batch, 1, dtype=torch.long, device="cuda")
                times, first = [], None
                with torch.inference_mode():
                    # One eager step first: the cache allocates its tensors outside the graphs
                    # (tensors a graph creates are overwritten by its next replay).
                    pos = torch.tensor([ctx - 1], device="cuda")
                    model(input_ids=ids, position_ids=pos.expand(batch, 1), cache_position=pos,
                          past_key_values=cache, use_cache=True)
                    for i in range(a.warmup + a.steps):
                        pos = torch.tensor([ctx + i], device="cuda")
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        # A new step: the graphs may overwrite the previous step's outputs.
                        torch.compiler.cudagraph_mark_step_begin()
                        out = step_fn(input_ids=ids, position_ids=pos.expand(batch, 1), cache_position=pos,
                                      past_key_values=cache, use_cache=True)
                        nxt = out.logits[:, -1].argmax(-1).tolist()
                        del out
                        dt = time.perf_counter() - t
                        ids = torch.tensor(nxt, device="cuda").view(batch, 1)
                        if i == 0:
                            first = dt
                        if i >= a.warmup:
                            times.append(dt)
                med = statistics.median(times)
                row.update({"ms_per_step": med * 1e3, "tok_s": batch / med, "min_ms": min(times) * 1e3,
                            "max_ms": max(times) * 1e3, "first_step_s": first})
                print(f"{batch:>5} {ctx:>7} | {med * 1e3:>8.2f} {batch / med:>9.1f} {min(times) * 1e3:>7.2f} "
                      f"{max(times) * 1e3:>7.2f} | {first:.1f}", flush=True)
                del cache
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of memory: {e}".splitlines()[0]
                print(f"{batch:>5} {ctx:>7} | does not fit in GPU memory", flush=True)
            except Exception as e:  # a failed case is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                print(f"{batch:>5} {ctx:>7} | failed: {row['error']}", flush=True)
            torch.cuda.empty_cache()
            rows.append(row)
            dump(a, rows, gpu, params, t0)


def dump(a, rows, gpu, params, t0):
    """Writes the JSON (after every case: a call cut short keeps what it measured)."""
    res = {"anchor": "transformers static cache + torch.compile(mode='reduce-overhead')", "gpu": gpu,
           "torch": torch.__version__, "transformers": transformers.__version__, "dtype": a.dtype,
           "parameters": params, "steps": a.steps, "warmup": a.warmup, "rows": rows,
           "seconds": time.time() - t0}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
