#!/usr/bin/env python3
"""VeloqCache against DynamicCache on this CPU, phase by phase (docs/python.md): SmolLM2 loaded by
transformers from the GGUF file scripts/fetch-data brings, vq-4 calibrated by `vt.calibrate` on
4,096 tokens of *Persuasion* (cached in /tmp), then a prompt of N tokens of *Emma* prefilled and
24 greedy steps timed one by one, every cache in turn, two rounds: DynamicCache, VeloqCache
(default: veloq's kernels on a thread of their own) and VeloqCache on rayon's process-wide pool. `--profile` adds torch's
profile of 8 VeloqCache steps.

    python3 scripts/hf-cpu-phases.py [N=2048] [--profile]
"""
import pathlib, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
import veloq.transformers as vt

torch.manual_seed(0)
cache_dir = pathlib.Path.home() / ".cache" / "veloq"
gguf = "smollm2-135m-instruct.q4_1.gguf"
tok = AutoTokenizer.from_pretrained(cache_dir, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(cache_dir, gguf_file=gguf, attn_implementation="veloq").eval()
print("dtype", model.dtype, "threads", torch.get_num_threads())
out = pathlib.Path("/tmp/smollm2-hf.vq-4.safetensors")
cal = vt.calibrate(model, tok, cache_dir / "austen" / "persuasion.txt", tokens=4096, out=out) if not out.exists() else out
n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2048
ids = tok((cache_dir / "austen" / "emma.txt").read_text()[50_000:], return_tensors="pt").input_ids[:, :n]
kw = vt._cache_kwarg(model)
for rnd in range(2):
    for label in ["dynamic", "veloq", "veloq-pool"]:
        # veloq: the default (its kernels on one thread of its own); veloq-pool: on rayon's
        # process-wide pool, one thread a core, as before `threads` existed.
        if label == "dynamic":
            cache = DynamicCache()
        else:
            cache = vt.VeloqCache(model, cal)
            if label == "veloq-pool":
                cache.native = vt.KvCache(**{**cache._spec, "threads": None})
        with torch.no_grad():
            t = time.perf_counter()
            o = model(ids, use_cache=True, **{kw: cache})
            pre = time.perf_counter() - t
            nxt = o.logits[:, -1:].argmax(-1)
            ts = []
            for _ in range(24):
                t = time.perf_counter()
                o = model(nxt, use_cache=True, **{kw: cache})
                nxt = o.logits[:, -1:].argmax(-1)
                ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"round {rnd} {label:8} prefill {n} tok {pre:6.2f} s  decode median {1e3*ts[len(ts)//2]:7.2f} ms/step (min {1e3*ts[0]:.2f})", flush=True)
if "--profile" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    cache = vt.VeloqCache(model, cal)
    with torch.no_grad():
        o = model(ids, use_cache=True, **{kw: cache})
        nxt = o.logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(8):
                o = model(nxt, use_cache=True, **{kw: cache})
                nxt = o.logits[:, -1:].argmax(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
