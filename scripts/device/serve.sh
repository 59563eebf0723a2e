#!/usr/bin/env bash
# `veloq-lab bench serve` on a GPU in one device call: the server and its clients both on the device,
# SmolLM2 (the real file, fp16 vs VecInfer) and the Llama-3.1-8B geometry (random weights and
# codebooks, fp16 vs 2-bit VecInfer), each at its own KV budget.
#
#   scripts/device/serve.sh VELOQ_LAB MODEL.gguf CALIBRATION CACHE_DIR OUT_DIR [SMOL_BUDGET] [L8B_BUDGET]
#
# VELOQ_LAB is built here with --features cuda (../shared/DEVICE.md). CACHE_DIR becomes VELOQ_CACHE
# (austen/emma.txt for the prompts); CALIBRATION is the vq-4 one. GPU caches reserve every slot's context, so the servers run
# with --max-context 4096, the capacity load's context. ALSO names more SmolLM2 calibrations
# (comma separated) served side by side. Writes OUT_DIR/serve-{smollm2,llama8b}.*
set -uo pipefail
veloq=$1 model=$2 calibration=$3 cache=$4 out=$5
smol_budget=${6:-512MiB} l8b_budget=${7:-4GiB}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_CACHE=$cache
start=$(date +%s)
"$veloq" bench serve --device cuda --model "$model" --calibration "$calibration" ${ALSO:+--also "$ALSO"} --kv-budget "$smol_budget" \
  --concurrency 1,8,32 --capacity-requests 64 --json "$out/serve-smollm2.json" > "$out/serve-smollm2.txt" 2>&1
echo "smollm2 rc $? in $(( $(date +%s) - start )) s"
cat "$out/serve-smollm2.txt"
start=$(date +%s)
"$veloq" bench serve --device cuda --model synthetic:llama8b --kv-budget "$l8b_budget" \
  --concurrency 1,8,32 --capacity-requests 96 --json "$out/serve-llama8b.json" > "$out/serve-llama8b.txt" 2>&1
echo "llama8b rc $? in $(( $(date +%s) - start )) s"
cat "$out/serve-llama8b.txt"
