"""One chat request with n=8 choices, then n=1, over a 1,727-token prompt (the start of Emma) on
SmolLM2 and vq-4, served on CUDA with forks (the default) and without (--no-prefix-cache), each
server a fresh process, two rounds: the request's wall time, the prompt tokens it fed, the forks.
The GPU side of scripts/bench-n-choices.sh, in one device call (curl is not on the device):

    python3 scripts/device/n-choices.py VELOQ MODEL.gguf CALIBRATION TEXT
"""
import json, os, subprocess, sys, time, urllib.request
V, M, C, T = sys.argv[1:5]
text = open(T).read()[:7000] + "\n\nSummarise the passage in one sentence."
def get(port, path):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=120).read().decode()
def metric(port, name):
    return next(float(l.split()[1]) for l in get(port, "/metrics").splitlines() if l.startswith(name + " "))
for r in (1, 2):
    for mode in ("fork", "nofork"):
        port = 18000 + 10 * r + (mode == "nofork")
        args = [V, "serve", "--device", "cuda", "--model", M, "--calibration", C, "--method", "vq-4", "--port", str(port), "--max-context", "4096"]
        if mode == "nofork":
            args.append("--no-prefix-cache")
        log = open(f"/tmp/serve-{mode}-{r}.log", "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                get(port, "/health"); break
            except Exception:
                if p.poll() is not None:
                    print(open(log.name).read()[-2000:]); sys.exit(1)
                time.sleep(0.2)
        for n in (8, 1):
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 1.0, "seed": 1, "n": n, "ignore_eos": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"})
            fed0 = metric(port, "veloq_prompt_tokens_total")
            t0 = time.time(); reply = json.loads(urllib.request.urlopen(req, timeout=300).read()); dt = time.time() - t0
            print(f"round {r} {mode} n={n}: {dt:.3f} s, prompt {reply['usage']['prompt_tokens']}, fed {metric(port, 'veloq_prompt_tokens_total') - fed0:.0f}, forks so far {metric(port, 'veloq_prefix_forks_total'):.0f}, completion {reply['usage']['completion_tokens']}", flush=True)
        p.terminate(); p.wait()
