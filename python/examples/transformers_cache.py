"""A Hugging Face transformers model with its KV cache kept as veloq codes: the model loaded by
transformers (here SmolLM2 from the GGUF file scripts/fetch-data brings), calibrated once on its own
keys and values, then generating with VeloqCache beside DynamicCache, with the bytes each holds.

    scripts/fetch-data && pip install './python[transformers]' gguf accelerate
    python python/examples/transformers_cache.py

On a GPU (veloq built with `MATURIN_PEP517_ARGS="--features cuda" pip install …`) the model and
both caches live on it: VeloqCache follows the model's device.
"""

import pathlib
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import veloq.transformers as vt  # registers attn_implementation="veloq"

cache_dir = pathlib.Path.home() / ".cache" / "veloq"
gguf = "smollm2-135m-instruct.q4_1.gguf"
tok = AutoTokenizer.from_pretrained(cache_dir, gguf_file=gguf)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(cache_dir, gguf_file=gguf, attn_implementation="veloq").to(device).eval()

out = cache_dir / "smollm2-hf.vq-4.safetensors"
cal = vt.calibrate(model, tok, cache_dir / "austen" / "persuasion.txt", tokens=4096, out=out) if not out.exists() else out

text = (cache_dir / "austen" / "emma.txt").read_text()[50_000:58_000]
messages = [{"role": "user", "content": text + "\n\nWho is this passage about? Answer in one sentence."}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].to(device)
print(f"prompt: {ids.shape[1]} tokens")
for label, cache in [("DynamicCache", DynamicCache()), ("VeloqCache vq-4", vt.VeloqCache(model, cal))]:
    t = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache)
    print(f"{label:16} {vt.kv_bytes(cache) / 2**20:6.1f} MiB  {time.perf_counter() - t:5.1f} s  "
          f"{tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)!r}")
