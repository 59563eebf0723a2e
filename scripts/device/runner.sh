#!/usr/bin/env bash
# The CUDA runner benchmark in one device call (../shared/DEVICE.md has the build recipe):
#   cargo build --release -p veloq-cli -p veloq-lab --features veloq-lab/cuda --target-dir target-cuda
#   strip + xz the binaries to .device/veloq.xz and .device/veloq-lab.xz; carry .device (with the SmolLM2 GGUF and its
#   vq-2 and vq-4 calibrations, or their parts) in the call.
# Usage: scripts/device/runner.sh GGUF CALIBRATION OUT_DIR [extra `veloq-lab bench runner` args]
set -euo pipefail
gguf=$1 cal=$2 out=$3
shift 3
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_FONT=${VELOQ_FONT:-.device/DejaVuSans.ttf}
for b in veloq veloq-lab; do
  [ -x .device/$b ] || { xz -dkf .device/$b.xz && chmod +x .device/$b; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Kernel correctness first (quantize and attention against the CPU path, many shapes).
.device/veloq-lab bench cuda --check-only | tail -n 20
# The runner: CPU/CUDA agreement, decode speed and memory, budget. Pinned to one
# core: decode steps are bound by host launch overhead, and an unpinned host drifted.
pin=$(command -v taskset >/dev/null && echo "taskset -c 3" || true)
$pin .device/veloq-lab bench runner --model "$gguf" --calibration "$cal" \
  --json "$out/bench-runner-h200.json" --plot "$out/bench-runner-h200.png" "$@" | tee "$out/bench-runner-h200.txt"
# What a user types.
for m in fp16 vq-2; do
  .device/veloq generate --device cuda --method "$m" --model "$gguf" --calibration "$cal" --max-tokens 48 \
    --prompt "Why is the sky blue? Answer in two sentences." 2>&1 | tee -a "$out/generate-cuda.txt"
done
