#!/usr/bin/env bash
# The needle-in-a-haystack grid on a GPU, in one device call: `veloq-lab eval needle --device cuda`
# with every prompt of a grid cell batched (16 cache slots), first checked against batch 1 on a
# few prompts (the batched answers must be the same text), then the whole grid.
#
#   scripts/device/needle.sh VELOQ_LAB MODEL CACHE_DIR OUT_DIR "CHECK ARGS" [GRID ARGS…]
#
# CHECK ARGS and GRID ARGS are `veloq-lab eval needle` arguments: a small grid for the batch check
# (e.g. "--lengths 1024 --depths 0,50,100 --keys 2 --methods vq-k4v2") and the real one.
#
# VELOQ_LAB is built here with --features cuda (../shared/DEVICE.md). CACHE_DIR becomes VELOQ_CACHE: it
# holds austen/emma.txt and austen/persuasion.txt (scripts/fetch-data) and eval/, the methods'
# calibrations made here beforehand with the same --lengths, --methods and --calib-tokens:
#   veloq-lab eval needle --lengths … --methods … --calibrate-only      (then copy ~/.cache/veloq/eval)
# so the device spends its time on the grid, not on k-means. Writes OUT_DIR/needle.{txt,json,png}
# (the JSON after every method, so a run cut short keeps what it finished; `--replot` draws it).
set -uo pipefail
veloq=$1 model=$2 cache=$3 out=$4 check=$5
shift 5
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_CACHE=$cache
# Batch 16 against batch 1 on the small grid: the same answers expected (greedy; a near-tie may
# flip a token, so the check reports rather than stops the grid).
for b in 1 16; do
  # shellcheck disable=SC2086
  "$veloq" eval needle --device cuda --model "$model" $check --batch $b \
    --json "$out/check-batch$b.json" > "$out/check-batch$b.txt" 2>&1 || echo "check batch $b failed"
done
python3 - "$out" <<'EOF'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/check-batch{n}.json"))["answers"] for n in (1, 16))
same = sum(x["answer"] == y["answer"] for x, y in zip(a, b))
print(f"batch 16 vs batch 1: {same}/{len(a)} answers identical")
EOF
start=$(date +%s)
# NEEDLE_TIMEOUT (seconds) ends the grid early; the methods finished by then are in the JSON.
${NEEDLE_TIMEOUT:+timeout "$NEEDLE_TIMEOUT"} "$veloq" eval needle --device cuda --model "$model" "$@" \
  --json "$out/needle.json" --plot "$out/needle.png" > "$out/needle.txt" 2> "$out/needle.err"
echo "grid rc $? in $(( $(date +%s) - start )) s"
tail -n 40 "$out/needle.err"
