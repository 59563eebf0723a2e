"""How close veloq.transformers stays to DynamicCache on SmolLM2 (CPU), and in how many bytes:
the next-token KL after 1k and 2k positions of Emma held as vq-4 codes (calibrated on 4k tokens
of Persuasion), the cache's bytes against an f16 cache's, and how many greedy tokens agree from
the start on five chat prompts.

    scripts/fetch-data && pip install './python[transformers]' gguf accelerate
    python python/examples/transformers_fidelity.py
"""

import pathlib

import torch
import transformers

import veloq.transformers as vt

cache_dir = pathlib.Path.home() / ".cache" / "veloq"
gguf = "smollm2-135m-instruct.q4_1.gguf"
tok = transformers.AutoTokenizer.from_pretrained(cache_dir, gguf_file=gguf)
model = transformers.AutoModelForCausalLM.from_pretrained(cache_dir, gguf_file=gguf, attn_implementation="veloq").eval()
cal = vt.calibrate(model, tok, cache_dir / "austen" / "persuasion.txt", tokens=4096)
g = vt.geometry(model)

emma = (cache_dir / "austen" / "emma.txt").read_text()[100_000:130_000]
for n in (1024, 2048):
    ids = tok(emma, return_tensors="pt").input_ids[:, :n]
    with torch.no_grad():
        ref = model(ids, cache=transformers.DynamicCache()).logits[0, -1]
        cache = vt.VeloqCache(model, cal, max_context=4096)
        model(ids[:, :-1], cache=cache)
        got = model(ids[:, -1:], cache=cache).logits[0, -1]
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((p.exp() * (p - q)).sum())
    f16 = n * g["layers"] * g["kv_heads"] * g["head_dim"] * 2 * 2
    print(f"ctx {n}: next-token KL {kl:.4f}; {vt.kv_bytes(cache)} bytes against f16's {f16} "
          f"({f16 / vt.kv_bytes(cache):.2f}x smaller)")

agree = []
for prompt in ["List the days of the week.", "What is the capital of France?", "Write a haiku about the sea.",
               "Explain photosynthesis in one sentence.", "Name three colours."]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    a = model.generate(ids, max_new_tokens=32, do_sample=False, cache=transformers.DynamicCache())[0, ids.shape[1]:]
    b = model.generate(ids, max_new_tokens=32, do_sample=False, cache=vt.VeloqCache(model, cal))[0, ids.shape[1]:]
    n = min(len(a), len(b))
    agree.append((int((a[:n] == b[:n]).int().cumprod(0).sum()), n))
print("greedy tokens agreeing from the start, of those generated:", agree)
