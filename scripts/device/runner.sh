#!/usr/bin/env bash
# The CUDA runner benchmark in one device call (../shared/DEVICE.md has the build recipe):
#   cargo build --release -p veloq-cli --features cuda --target-dir target-cuda
#   strip + xz the binary to .device/veloq.xz; carry .device (with the SmolLM2 GGUF and its
#   calibration, or their parts) in the call.
# Usage: scripts/device/runner.sh GGUF CALIBRATION OUT_DIR [extra `veloq bench runner` args]
set -euo pipefail
gguf=$1 cal=$2 out=$3
shift 3
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_FONT=${VELOQ_FONT:-.device/DejaVuSans.ttf}
[ -x .device/veloq ] || { xz -dkf .device/veloq.xz && chmod +x .device/veloq; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Kernel correctness first (quantize and attention against the CPU path, many shapes).
.device/veloq bench cuda --check-only | tail -n 20
# The runner: CPU/CUDA agreement, decode speed and memory, budget. Pinned to one
# core: decode steps are bound by host launch overhead, and an unpinned host drifted.
pin=$(command -v taskset >/dev/null && echo "taskset -c 3" || true)
$pin .device/veloq bench runner --model "$gguf" --calibration "$cal" \
  --json "$out/bench-runner-h200.json" --plot "$out/bench-runner-h200.png" "$@" | tee "$out/bench-runner-h200.txt"
# What a user types.
for m in fp16 vecinfer; do
  .device/veloq generate --device cuda --method "$m" --model "$gguf" --calibration "$cal" --max-tokens 48 \
    --prompt "Why is the sky blue? Answer in two sentences." 2>&1 | tee -a "$out/generate-cuda.txt"
done
