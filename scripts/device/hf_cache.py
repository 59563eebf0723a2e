#!/usr/bin/env python3
"""veloq's cache inside Hugging Face transformers on the GPU (issue 33), in one device call:
`VeloqCache` (veloq's CUDA kernels over codes, the step's tensors handed over by device address)
against transformers' own caches on the same model and the same positions.

1. Fidelity on the real SmolLM2 (loaded by transformers from the GGUF file): `vt.calibrate` on
   *Persuasion* on the GPU, then greedy decoding of chat prompts through DynamicCache, VeloqCache
   fp16 (must give DynamicCache's tokens: the CUDA path's exactness) and VeloqCache vq-4 (tokens
   agreeing from the start free-running, and teacher-forced over DynamicCache's continuation: the
   reference's token at every step whose top two logits are 0.5 apart).
2. Speed and memory at each context: the cache is filled with `context` positions (keys and
   values drawn at random, appended through each cache's own API — what a prefill would leave,
   without spending the call's minutes on prefills), then `steps` greedy decode steps are timed
   one by one (a model forward of one token + argmax read back, synchronised); every cache of a
   context in turn, `--passes` times. Every timed run starts a little further on (its own
   `positions`), so no step attends a length an earlier run attended: torch's cuDNN attention
   plans each new key length on the host (about 1 ms a call) and keeps the plan, so a run over
   lengths seen before times what generation never sees (the "slow first pass" of earlier
   sessions). Caches: DynamicCache (`dynamic-sdpa`: transformers' SDPA as torch picks its
   backend; `dynamic-flash`: the same with torch's flash backend forced; `dynamic`: through
   veloq's attention function, which falls back to SDPA), VeloqCache (default vq-4; on the 8B config calibrated by `vt.calibrate` on random
   token ids, the runner's synthetic stand-in), QuantizedCache (HQQ backend, 4 bits, transformers'
   KIVI-style cache) and, on the 8B config, StaticCache + torch.compile(mode="reduce-overhead")
   (the anchor `scripts/device/hf_decode.py` measures). `veloq-compiled`: VeloqCache with the
   model's forward under `torch.compile` (default mode; veloq's native calls are graph breaks),
   the first step's time — the compilation — reported apart. KV bytes are what each cache holds
   (`vt.kv_bytes`); peak memory is torch's allocator peak above the model plus what veloq holds.

Usage: hf_cache.py --gguf smollm2.gguf --text persuasion.txt --json OUT [--contexts 8192,32768,131072]
"""
import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import veloq
import veloq.transformers as vt
from hf_models import llama8b_config, random_model

T0 = time.time()


def log(*a):
    # The host's load average rides along: eager decode is bound by the host, so a busy host
    # (another tenant, a build) shows in every step time (seen: 25-45 ms for a 20 ms step).
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[{time.time() - T0:6.0f}s load {load}]", *a, flush=True)


def forward(model, ids, cache):
    return model(input_ids=ids, use_cache=True, **{vt._cache_kwarg(model): cache})


def greedy(model, prompt_ids, cache, n):
    """n greedy tokens after the prompt and the logits (float32) each was chosen from."""
    out = forward(model, prompt_ids, cache)
    toks, logits = [], []
    for _ in range(n):
        logits.append(out.logits[0, -1].float())
        toks.append(int(logits[-1].argmax()))
        out = forward(model, torch.tensor([[toks[-1]]], device=prompt_ids.device), cache)
    return toks, logits


def first_kl(ref_logits, logits):
    """KL(reference || other) of the first generated token's distribution."""
    p, q = torch.log_softmax(ref_logits[0], -1), torch.log_softmax(logits[0], -1)
    return float((p.exp() * (p - q)).sum())


def teacher_forced(model, prompt_ids, ref, ref_logits, cache, margin=0.5):
    """DynamicCache's greedy continuation `ref` fed through `cache` one token at a time: at every
    step where the reference's top two logits are more than `margin` apart (beyond vq-4's logit
    error; closer calls may go either way, and a free-running comparison ends at the first of
    them), does `cache` pick the reference's token? Returns (clear steps, agreeing, max |dlogit|)."""
    logits = forward(model, prompt_ids, cache).logits[0, -1]
    clear = agree = 0
    worst = 0.0
    for i, tok_i in enumerate(ref):
        r = ref_logits[i]
        worst = max(worst, float((logits.float() - r).abs().max()))
        top = r.topk(2).values
        if float(top[0] - top[1]) > margin:
            clear += 1
            agree += int(int(logits.argmax()) == tok_i)
        logits = forward(model, torch.tensor([[tok_i]], device=prompt_ids.device), cache).logits[0, -1]
    return clear, agree, worst


def fidelity(a, res):
    log("fidelity: SmolLM2 from", a.gguf)
    import os
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16, attn_implementation="veloq").cuda().eval()
    text = open(a.text, encoding="utf-8").read()
    t = time.time()
    cal = vt.calibrate(model, tok, text, method="vq-4", tokens=4096)
    res["smollm2_calibrate_s"] = time.time() - t
    log(f"vt.calibrate vq-4 on the GPU model: {res['smollm2_calibrate_s']:.1f} s")
    prompts = [
        "Explain in two sentences why the sky is blue.",
        "Write a short poem about the sea.",
        "What is the capital of France, and what is it known for?",
        "List three uses of a paperclip.",
        "Summarise the plot of Romeo and Juliet.",
        text[20000:26000] + "\n\nWho is the passage above about? Answer in one sentence.",
    ]
    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"].cuda()
            ref, ref_logits = greedy(model, ids, DynamicCache(config=model.config), a.tokens)
            f16, _ = greedy(model, ids, vt.VeloqCache(model, method="fp16", max_context=ids.shape[1] + a.tokens + 8), a.tokens)
            vq, vq_logits = greedy(model, ids, vt.VeloqCache(model, cal, max_context=ids.shape[1] + a.tokens + 8), a.tokens)
            agree = lambda x: next((i for i, (u, v) in enumerate(zip(ref, x)) if u != v), len(ref))
            kl = first_kl(ref_logits, vq_logits)
            clear, forced, worst = teacher_forced(model, ids, ref, ref_logits,
                                                  vt.VeloqCache(model, cal, max_context=ids.shape[1] + a.tokens + 8))
            row = {"prompt_tokens": ids.shape[1], "fp16_agree": agree(f16), "vq4_agree": agree(vq), "kl_first": kl,
                   "vq4_clear_steps": clear, "vq4_clear_agree": forced, "vq4_max_abs_dlogit": worst,
                   "dynamic": tok.decode(ref), "vq4": tok.decode(vq)}
            rows.append(row)
            log(f"prompt {ids.shape[1]:>5} tokens: fp16 agrees {row['fp16_agree']}/{a.tokens}, vq-4 {row['vq4_agree']}/{a.tokens} "
                f"free-running, {forced}/{clear} teacher-forced where the reference's top two are > 0.5 apart "
                f"(max |dlogit| {worst:.3f}), first-step KL {kl:.5f}")
    res["fidelity"] = rows
    del model
    torch.cuda.empty_cache()
    return cal


def agreement(a, res, model, cal):
    """Greedy tokens after random prompts: VeloqCache fp16 must give DynamicCache's exactly (the
    CUDA path adds no error of its own); vq-4's agreement is reported."""
    rows = []
    with torch.no_grad():
        for seed, n in [(1, 64), (2, 700), (3, 3000)]:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).cuda()
            ref, ref_logits = greedy(model, ids, DynamicCache(config=model.config), a.tokens)
            f16, _ = greedy(model, ids, vt.VeloqCache(model, method="fp16", max_context=n + a.tokens + 8), a.tokens)
            vq, vq_logits = greedy(model, ids, vt.VeloqCache(model, cal, max_context=n + a.tokens + 8), a.tokens)
            first = lambda x: next((i for i, (u, v) in enumerate(zip(ref, x)) if u != v), len(ref))
            kl = first_kl(ref_logits, vq_logits)
            rows.append({"prompt_tokens": n, "fp16_agree": first(f16), "vq4_agree": first(vq), "kl_first": kl})
            log(f"8B config, random prompt of {n}: fp16 agrees {first(f16)}/{a.tokens}, vq-4 {first(vq)}/{a.tokens}, KL {kl:.5f}")
    res["agreement_llama8b"] = rows
    dump(a, res)


def llama8b(longest):
    model = random_model(llama8b_config(longest), torch.float16)
    set_attn(model, "veloq")
    return model


def set_attn(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def fill(cache, g, ctx, gen):
    """Appends ctx random positions to every layer through the cache's own API."""
    chunk = 8192
    for layer in range(g["layers"]):
        for s in range(0, ctx, chunk):
            n = min(chunk, ctx - s)
            k = torch.randn(1, g["kv_heads"], n, g["head_dim"], device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn(1, g["kv_heads"], n, g["head_dim"], device="cuda", dtype=torch.float16, generator=gen)
            if isinstance(cache, vt.VeloqCache):
                cache._ensure(k)
                stream = torch.cuda.current_stream().cuda_stream
                cache.native.append(layer, vt._cuda_rows(k), vt._cuda_rows(v), stream=stream)
            else:
                cache.update(k, v, layer)


def time_steps(model, cache, steps, warmup, step_fn=None, ctx=None, call=None, first=None):
    """Times of `steps` decode steps after `warmup` (the first's time, compilation included, into
    `first["s"]` if given); `step_fn`: a compiled StaticCache step, `call`: the model's forward
    compiled as it is."""
    ids = torch.ones(1, 1, dtype=torch.long, device="cuda")
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if call is not None:
                out = call(input_ids=ids, use_cache=True, **{vt._cache_kwarg(model): cache})
            elif step_fn is None:
                out = forward(model, ids, cache)
            else:
                pos = torch.tensor([ctx + i], device="cuda")
                torch.compiler.cudagraph_mark_step_begin()
                out = step_fn(input_ids=ids, position_ids=pos.view(1, 1), cache_position=pos, past_key_values=cache, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
            del out
            times.append(time.perf_counter() - t)
            ids = torch.tensor([[nxt]], device="cuda")
    if first is not None:
        first["s"] = times[0]
    return times[warmup:]


def speed(a, res, name, model, cal, contexts):
    g = vt.geometry(model)
    base = torch.cuda.memory_allocated()
    rows = []
    compiled = None
    compiled_forward = None  # the model's forward under torch.compile (veloq-compiled), compiled once
    runs = 0
    for ctx in contexts:
        # Every cache of a context once, then again (--passes), each run at lengths of its own.
        for p, kind in itertools.product(range(a.passes), a.caches.split(",")):
            if kind == "static" and name != "llama8b":
                continue
            positions = ctx + runs * (a.steps + a.warmup)
            runs += 1
            row = {"model": name, "context": ctx, "positions": positions, "cache": kind, "pass": p + 1}
            if time.time() - T0 > a.budget_s:
                row["skipped"] = "time budget of the call"
                rows.append(row)
                log(f"{name} {ctx} {kind}: skipped (time budget)")
                continue
            gen = torch.Generator(device="cuda").manual_seed(ctx)
            cache = None
            backend = contextlib.nullcontext()
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                if kind in ("dynamic", "dynamic-sdpa", "dynamic-flash"):
                    # dynamic-sdpa: the model's attention set to transformers' own SDPA, not veloq's
                    # function falling back to it (the two must time alike).
                    set_attn(model, "veloq" if kind == "dynamic" else "sdpa")
                    cache = DynamicCache(config=model.config)
                    if kind == "dynamic-flash":
                        backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
                elif kind in ("veloq", "veloq-compiled"):
                    cache = vt.VeloqCache(model, cal, max_context=positions + a.steps + a.warmup + 8)
                elif kind == "hqq":
                    from transformers.cache_utils import QuantizedCache
                    cache = QuantizedCache(backend="hqq", config=model.config, nbits=4)
                elif kind == "static":
                    from transformers import StaticCache
                    try:
                        cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=positions + a.steps + a.warmup + 8, device="cuda", dtype=torch.float16)
                    except TypeError:
                        cache = StaticCache(config=model.config, max_cache_len=positions + a.steps + a.warmup + 8)
                t = time.time()
                if kind == "static":
                    # A static cache costs its length whatever it holds (hf_decode.py): one eager step allocates it.
                    set_attn(model, "sdpa")
                    with torch.no_grad():
                        pos = torch.tensor([positions - 1], device="cuda")
                        model(input_ids=torch.ones(1, 1, dtype=torch.long, device="cuda"), position_ids=pos.view(1, 1),
                              cache_position=pos, past_key_values=cache, use_cache=True)
                    if compiled is None:
                        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
                    times = time_steps(model, cache, a.steps, a.warmup, step_fn=compiled, ctx=positions)
                    set_attn(model, "veloq")
                else:
                    fill(cache, g, positions, gen)
                    torch.cuda.synchronize()
                    row["fill_s"] = time.time() - t
                    call, first = None, {}
                    if kind == "veloq-compiled":
                        compiled_forward = compiled_forward or torch.compile(model.forward)
                        call = compiled_forward
                    with backend:
                        times = time_steps(model, cache, a.steps, a.warmup, call=call, first=first)
                    if call is not None:
                        row["first_step_s"] = first["s"]
                    set_attn(model, "veloq")
                med = statistics.median(times)
                veloq_bytes = cache.resident_bytes if isinstance(cache, vt.VeloqCache) else 0
                row.update({
                    "ms_per_step": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
                    "kv_bytes": vt.kv_bytes(cache),
                    "peak_bytes": torch.cuda.max_memory_allocated() - base + veloq_bytes,
                })
                log(f"{name} ctx {ctx:>6} {kind:>12} pass {p + 1}: {med * 1e3:8.2f} ms/step (min {min(times) * 1e3:.2f}) "
                    f"KV {row['kv_bytes'] / 2**30:7.3f} GiB, peak {row['peak_bytes'] / 2**30:7.3f} GiB"
                    + (f", first step {row['first_step_s']:.1f} s" if "first_step_s" in row else ""))
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = "out of memory"
                log(f"{name} ctx {ctx} {kind}: out of memory")
            except Exception as e:  # a failed case is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log(f"{name} ctx {ctx} {kind}: failed: {row['error']}")
                set_attn(model, "veloq")
            del cache
            rows.append(row)
            res.setdefault("speed", []).extend([row])
            dump(a, res)
    return rows


def dump(a, res):
    res["seconds"] = time.time() - T0
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--text")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--json", required=True)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--caches", default="dynamic-sdpa,dynamic-flash,veloq,hqq,static")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--passes", type=int, default=2, help="times each context's caches are timed, in turn")
    ap.add_argument("--skip", default="", help="parts to skip: fidelity,smollm2,llama8b,agreement")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "veloq": veloq.__version__, "steps": a.steps, "warmup": a.warmup}
    log(res)
    contexts = [int(c) for c in a.contexts.split(",")]
    cal = None
    if "fidelity" not in skip:
        cal = fidelity(a, res)
        dump(a, res)
    if "smollm2" not in skip:
        import os
        d, f = os.path.split(os.path.abspath(a.gguf))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16, attn_implementation="veloq").cuda().eval()
        model.config.max_position_embeddings = max(contexts) + 64
        if cal is None:
            tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
            cal = vt.calibrate(model, tok, open(a.text, encoding="utf-8").read(), tokens=4096)
        speed(a, res, "smollm2", model, cal, contexts)
        del model
        torch.cuda.empty_cache()
    if "llama8b" not in skip:
        model = llama8b(max(contexts) + 64)
        cal8 = None
        if "veloq" in a.caches.split(",") or "agreement" not in skip:
            t = time.time()
            ids = torch.randint(0, 128256, (a.calib_tokens,), generator=torch.Generator().manual_seed(0))
            cal8 = vt.calibrate(model, None, ids, method="vq-4", tokens=a.calib_tokens)
            res["llama8b_calibrate_s"] = time.time() - t
            log(f"8B config: vt.calibrate on {a.calib_tokens} random tokens {res['llama8b_calibrate_s']:.1f} s")
        if "agreement" not in skip:
            agreement(a, res, model, cal8)
        speed(a, res, "llama8b", model, cal8, contexts)
    dump(a, res)
    log("done")


if __name__ == "__main__":
    main()
