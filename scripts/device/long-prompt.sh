#!/usr/bin/env bash
# Long prompts through what a user types on CUDA: `veloq generate --device cuda --prompt-file`,
# fp16 and VecInfer vq-4, prompts cut from a novel at several lengths (characters; ~4.3 per token), the
# chunked prefill's tok/s and the KV line from each run.
#
#   scripts/device/long-prompt.sh VELOQ MODEL.gguf CALIBRATION TEXT "CHARS..." [OUT_DIR]
set -uo pipefail
veloq=$1 model=$2 calibration=$3 text=$4 lengths=$5
out=${6:-${OUT:-/tmp/veloq-long}}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
failed=0
for chars in $lengths; do
  { head -c "$chars" "$text"; printf '\n\nSummarise the passage above in one sentence.'; } > "$out/prompt-$chars.txt"
  for method in fp16 vq-4; do
    log="$out/long-$method-$chars.txt"
    timeout 240 "$veloq" generate --device cuda --model "$model" --calibration "$calibration" --method "$method" \
      --max-tokens 24 --max-context 65536 --prompt-file "$out/prompt-$chars.txt" > "$log" 2>&1
    rc=$?
    stats=$(grep -E '^\[' "$log" | tail -1)
    if [ $rc -ne 0 ] || [ -z "$stats" ]; then
      echo "FAIL  $method $chars chars (rc $rc): $(tail -2 "$log" | tr '\n' ' ')"; failed=1
    else
      echo "ok    $method $chars chars: $stats"
      echo "      $(grep -v '^\[' "$log" | tr '\n' ' ' | head -c 200)"
    fi
  done
done
exit $failed
