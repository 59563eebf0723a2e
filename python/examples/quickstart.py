"""veloq from Python on a real model: calibrate the 4-bit cache once, generate (whole and
streamed), chat, and serve the OpenAI API in this process.

    scripts/fetch-data && pip install ./python && python python/examples/quickstart.py
"""

import pathlib

import veloq

cache = pathlib.Path.home() / ".cache" / "veloq"
gguf = cache / "smollm2-135m-instruct.q4_1.gguf"

# The codebooks of the default method (vq-4), trained on the model's own keys and values over a
# novel; written where Model.open looks for them (~/.cache/veloq/<model>.vq-4.safetensors).
calibration = cache / "smollm2-135m-instruct.q4_1.vq-4.safetensors"
if not calibration.exists():
    veloq.calibrate(gguf, cache / "austen" / "persuasion.txt", method="vq-4",
                    progress=lambda stage, done, total: print(f"\r{stage} {done}/{total}", end="", flush=True))
    print()

model = veloq.Model.open(gguf)  # method "vq-4", on the CPU
print(model.info())
print(model.generate("Why is the sky blue? Answer in one sentence.", max_tokens=48))

stream = model.generate("Name three rivers of Europe.", max_tokens=48, stream=True)
for piece in stream:
    print(piece, end="", flush=True)
r = stream.result
print(f"\n[{len(r.tokens)} tokens, {r.decode_tok_s:.1f} tok/s, cache {r.kv_resident_bytes} bytes "
      f"against {r.kv_fp16_bytes} in f16]")

chat = model.chat()
print(chat.say("My name is Anne Elliot.", max_tokens=32).text)
print(chat.say("What is my name?", max_tokens=32).text)

with veloq.serve(model, port=0) as server:
    import json
    import urllib.request

    body = {"model": server.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    req = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    print(json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"])
