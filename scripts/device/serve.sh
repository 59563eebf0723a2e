#!/usr/bin/env bash
# `veloq-lab bench serve` on a GPU in one device call: the servers and their clients both on the
# device, SmolLM2 (the real file; its weights as stored and dequantized to f16, side by side) and
# the Llama-3.1-8B geometry (random f16 weights and codebooks), each at its own KV budget, every
# method at budget-bound loads of 32 and 128 clients.
#
#   scripts/device/serve.sh VELOQ_LAB MODEL.gguf CACHE_DIR OUT_DIR [SMOL_BUDGET] [L8B_BUDGET]
#
# VELOQ_LAB is built here with --features cuda (../shared/DEVICE.md). CACHE_DIR becomes VELOQ_CACHE:
# the VecInfer methods read their calibrations there under the default names (`veloq calibrate
# --method vq-4` writes them; a calibration made on this CPU serves as well), the prompts come from
# austen/emma.txt. Environment: METHODS (default fp16,vq-4,vq-2), WEIGHTS (SmolLM2's forms, default
# stored,f16), CONCURRENCY (default 32,128), L8B_METHODS (default fp16,vq-4), PARTS (which of
# smollm2,llama8b,transformers to run; default all three, for calls that stage in pieces). Writes
# OUT_DIR/serve-{smollm2,llama8b}.{txt,json} and, from scripts/device/hf_serve.py (transformers'
# continuous batching on the 8B config, same load, same budget), OUT_DIR/hf-serve-llama8b.*; exits
# non-zero if a load failed. L8B_BUDGET is given in GiB (4GiB).
set -uo pipefail
lab=$1 model=$2 cache=$3 out=$4
smol_budget=${5:-512MiB} l8b_budget=${6:-4GiB}
methods=${METHODS:-fp16,vq-4,vq-2} weights=${WEIGHTS:-stored,f16} levels=${CONCURRENCY:-32,128}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_CACHE=$cache
parts=,${PARTS:-smollm2,llama8b,transformers},
failed=0
# One model's loads: serve_load NAME KV_BUDGET ARGS… (the model, methods and weights in ARGS).
serve_load() {
  local name=$1 budget=$2 start
  shift 2
  start=$(date +%s)
  "$lab" bench serve --device cuda "$@" --kv-budget "$budget" --concurrency "$levels" --capacity-requests 64 \
    --json "$out/serve-$name.json" > "$out/serve-$name.txt" 2>&1 || failed=1
  echo "$name rc $failed in $(( $(date +%s) - start )) s"
  grep -v '<unknown>' "$out/serve-$name.txt"
}
if [[ $parts == *,smollm2,* ]]; then
  serve_load smollm2 "$smol_budget" --model "$model" --cache-dir "$cache" --methods "$methods" --weights "$weights"
fi
if [[ $parts == *,llama8b,* ]]; then
  serve_load llama8b "$l8b_budget" --model synthetic:llama8b --methods "${L8B_METHODS:-fp16,vq-4}"
fi
# The anchor a GPU user would pick instead, same call: transformers' continuous batching on the same
# random 8B config, the same load and a paged cache of the same budget.
if [[ $parts == *,transformers,* ]]; then
  start=$(date +%s)
  python3 "$(dirname "$0")/hf_serve.py" --concurrency "$levels" --kv-budget-gib "${l8b_budget%GiB}" \
    --json "$out/hf-serve-llama8b.json" > "$out/hf-serve-llama8b.txt" 2>&1 || failed=1
  echo "transformers rc $failed in $(( $(date +%s) - start )) s"
  grep -v -i warn "$out/hf-serve-llama8b.txt" | tail -4
fi
exit $failed
