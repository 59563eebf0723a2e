#!/usr/bin/env bash
# Eight clients at once, each a chat over the same 1,727-token document (the start of Emma) with a
# question of its own, $TOKENS tokens each (128), on SmolLM2 and the default vq-4 under a KV budget of
# $SEQS sequences of 2,560 positions (2.75; the server's own figures). Every later request forks the first
# one's cache; the binaries given (e.g. one whose forks copy their source's codes and one whose
# forks share them) serve the same load in turn, two rounds. Prints per server: wall time for all
# eight, the most sequences that ran at once, forks, prompt tokens fed, and the peaks of resident
# and borrowed KV bytes. A label starting with `llama` names a llama-server binary instead: q4_0
# KV, as many 2,048-position slots (`-np`) as the same budget holds at its 4.5 bits, prompt cache on.
#   scripts/bench-shared-prompt.sh LABEL=path/to/veloq [LABEL=path ...] [llama=path/to/llama-server]
# (the vq-4 calibration: `veloq calibrate --method vq-4 --model $DATA/smollm2-135m-instruct.q4_1.gguf`).
set -u
cd "$(dirname "$0")/.."
DATA=${VELOQ_CACHE:-$HOME/.cache/veloq}
M=$DATA/smollm2-135m-instruct.q4_1.gguf
C=$DATA/smollm2-135m-instruct.q4_1.vq-4.safetensors
TOKENS=${TOKENS:-128}
# The KV budget in sequences of 2,560 positions (veloq's own figures).
SEQS=${SEQS:-2.75}
# A veloq binary for the budget's figures (the first one given that is not llama-server).
V=target/release/veloq
for spec in "$@"; do [[ ${spec%%=*} == llama* ]] || { V=${spec#*=}; break; }; done
[ $# -gt 0 ] || set -- "veloq=target/release/veloq"
for round in 1 2; do
for spec in "$@"; do
  label=${spec%%=*}; B=${spec#*=}
  port=$((18000 + RANDOM % 1000))
  # The budget from veloq's own figures: shared tables + $SEQS sequences of 2,560 positions.
  CANDLE_NUM_THREADS=1 $V serve --model "$M" --calibration "$C" --method vq-4 --port $port --max-context 4096 --quiet > /tmp/shared-probe.log 2>&1 &
  pid=$!
  for i in $(seq 100); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.3; done
  budget=$(curl -s localhost:$port/v1/models | SEQS=$SEQS python3 -c '
import json, sys
v = json.load(sys.stdin)["data"][0]["veloq"]
per = {s["positions"]: s["bytes"] for s in v["kv_sequence_bytes"]}
import os
print(int(v["kv_shared_bytes"] + float(os.environ["SEQS"]) * (per[1024] + per[4096]) / 2))')
  kill $pid; wait $pid 2>/dev/null
  if [[ $label == llama* ]]; then
    # q4_0: 18 bytes per 32 elements; SmolLM2 holds 30 layers x 3 kv heads x 64 x (k, v) a position.
    slots=$(( budget / (30 * 3 * 64 * 2 * 18 / 32) / 2048 ))
    [ $slots -gt 0 ] || slots=1
    $B -m "$M" -c $((slots * 2048)) -np $slots -no-kvu -cram 0 -fa on -ctk q4_0 -ctv q4_0 -t 2 -ub 512 -b 512 \
      --host 127.0.0.1 --port $port --metrics --no-webui > /tmp/shared-$label.log 2>&1 &
  else
    CANDLE_NUM_THREADS=1 $B serve --model "$M" --calibration "$C" --method vq-4 --port $port --max-context 4096 \
      --kv-budget $budget --quiet > /tmp/shared-$label.log 2>&1 &
  fi
  pid=$!
  for i in $(seq 100); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.3; done
  python3 - "$port" "$DATA/austen/emma.txt" "$label" "$round" "$budget" "$TOKENS" <<'EOF'
import json, re, sys, threading, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, emma, label, rnd, budget, tokens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
doc = open(emma).read()[:7000]
questions = ["Who is Emma?", "Where does Emma live?", "Who is Mr. Woodhouse?", "Who is Miss Taylor?",
             "What happened at the wedding?", "Who is Mr. Knightley?", "What does Emma fear?", "Name a house."]
url = f"http://localhost:{port}"
peaks = {"veloq_requests_running": 0.0, "veloq_kv_resident_bytes": 0.0, "veloq_kv_borrowed_bytes": 0.0}
done = threading.Event()
llama = label.startswith("llama")
def poll():
    while not llama and not done.is_set():
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        for name in peaks:
            m = re.search(rf"^{name} (\S+)$", text, re.M)
            if m:
                peaks[name] = max(peaks[name], float(m.group(1)))
        time.sleep(0.2)
def ask(q):
    body = {"messages": [{"role": "user", "content": doc + "\n\n" + q}], "max_tokens": int(tokens),
            "temperature": 0, "ignore_eos": True}
    if llama:
        body["cache_prompt"] = True
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))
poller = threading.Thread(target=poll); poller.start()
t0 = time.time()
with ThreadPoolExecutor(len(questions)) as ex:
    answers = list(ex.map(ask, questions))
wall = time.time() - t0
done.set(); poller.join()
if llama:
    # llama-server reports each request's prompt tokens evaluated and taken from its slot's cache.
    fed = sum(a["timings"]["prompt_n"] for a in answers)
    cached = sum(a["timings"]["cache_n"] for a in answers)
    print(f"round {rnd} {label}: budget {budget / 2**20:.1f} MiB, wall {wall:.2f} s for 8 x {tokens} tokens, "
          f"fed {fed}, cached {cached}")
    sys.exit(0)
text = urllib.request.urlopen(url + "/metrics").read().decode()
metric = lambda n: float(re.search(rf"^{n} (\S+)$", text, re.M).group(1))
cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
print(f"round {rnd} {label}: budget {budget / 2**20:.1f} MiB, wall {wall:.2f} s for 8 x {tokens} tokens, "
      f"peak running {metric('veloq_requests_running_peak'):.0f}, forks {metric('veloq_prefix_forks_total'):.0f}, "
      f"fed {metric('veloq_prompt_tokens_total'):.0f}, cached {cached}, "
      f"peak resident {peaks['veloq_kv_resident_bytes'] / 2**20:.1f} MiB, "
      f"peak borrowed {peaks['veloq_kv_borrowed_bytes'] / 2**20:.1f} MiB")
EOF
  kill $pid; wait $pid 2>/dev/null
done
done
