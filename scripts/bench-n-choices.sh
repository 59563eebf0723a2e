#!/usr/bin/env bash
# One chat request with n=4 choices over a 1,727-token prompt (the start of Emma) on SmolLM2 and
# the default vq-4, served twice side by side: with forks (the default: the prompt fed once, the
# other choices copy the first one's cache) and without (--no-prefix-cache: each choice feeds it).
# Prints the request's wall time, the prompt tokens fed and the forks, two rounds.
#   cargo build --release -p veloq-cli && scripts/fetch-data && scripts/bench-n-choices.sh
# (the vq-4 calibration: `veloq calibrate --method vq-4 --model $DATA/smollm2-135m-instruct.q4_1.gguf`).
set -u
cd "$(dirname "$0")/.."
DATA=${VELOQ_CACHE:-$HOME/.cache/veloq}
B=target/release/veloq
M=$DATA/smollm2-135m-instruct.q4_1.gguf
C=$DATA/smollm2-135m-instruct.q4_1.vq-4.safetensors
text=$(head -c 7000 "$DATA/austen/emma.txt" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()+"\n\nSummarise the passage in one sentence."))')
for round in 1 2; do
for mode in fork nofork; do
  extra=""; [ $mode = nofork ] && extra="--no-prefix-cache"
  port=$((18000 + RANDOM % 1000))
  CANDLE_NUM_THREADS=1 $B serve --model "$M" --calibration "$C" --method vq-4 --port $port --max-context 4096 $extra > /tmp/nbench-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 100); do curl -s localhost:$port/health >/dev/null && break; sleep 0.3; done
  body="{\"messages\":[{\"role\":\"user\",\"content\":$text}],\"max_tokens\":16,\"temperature\":1.0,\"seed\":1,\"n\":4,\"ignore_eos\":true}"
  t0=$(date +%s.%N)
  curl -s localhost:$port/v1/chat/completions -H 'content-type: application/json' -d "$body" > /tmp/nbench-$mode.json
  t1=$(date +%s.%N)
  fed=$(curl -s localhost:$port/metrics | grep -E '^veloq_prompt_tokens_total ' | awk '{print $2}')
  forks=$(curl -s localhost:$port/metrics | grep -E '^veloq_prefix_forks_total ' | awk '{print $2}')
  prompt=$(python3 -c 'import json; print(json.load(open("/tmp/nbench-'$mode'.json"))["usage"]["prompt_tokens"])')
  echo "round $round $mode: $(awk "BEGIN{printf \"%.2f\", $t1-$t0}") s for n=4 × 16 tokens, prompt $prompt tokens, fed $fed, forks $forks"
  kill $pid; wait $pid 2>/dev/null
done
done
