#!/usr/bin/env bash
# Where a fresh machine's first serving processes lose their time: run on a machine just started,
# before anything else touches the GPU. The 8B serving load (fp16 and the default, 32 clients)
# runs ROUNDS times; meanwhile every veloq-lab process's storage reads (/proc/PID/io read_bytes)
# and threads waiting on the disk (state D) are sampled every 100 ms and the GPU's clocks every
# 250 ms, and, where KERNEL_TIMELINE_SO names a built scripts/device/kernel_timeline.c, every
# process's kernels are traced (GPU busy against host gaps). Round 1 against the later rounds
# tells GPU work, host gaps, disk reads and clocks apart (results/README.md, "Kernels kept as
# machine code, and where a fresh machine's first servers lose their time").
#
#   scripts/device/first-process.sh LAB TEXT [OUT_DIR]
#
# LAB is a veloq-lab built with --features cuda; TEXT a plain-text novel (the load's prompts).
set -uo pipefail
lab=$1 text=$2
out=${3:-${OUT:-/tmp/veloq-first-process}}
rounds=${ROUNDS:-2}
mkdir -p "$out" /tmp/first-process/austen
cp "$text" /tmp/first-process/austen/emma.txt
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm,persistence_mode,driver_version --format=csv | tee "$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active \
  --format=csv -lms 250 > "$out/clocks.csv" 2>&1 &
clocks=$!
(
  while :; do
    now=$(date +%s.%N)
    for p in $(pgrep -f "^$lab"); do
      read_bytes=$(awk '/^read_bytes/ {print $2}' "/proc/$p/io" 2>/dev/null)
      waiting=$(cat /proc/"$p"/task/*/stat 2>/dev/null | awk '$3 == "D"' | wc -l)
      echo "$now $p ${read_bytes:-0} $waiting $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-80)"
    done
    sleep 0.1
  done
) > "$out/io.txt" 2>&1 &
sampler=$!
trace=()
if [ -n "${KERNEL_TIMELINE_SO:-}" ]; then
  cupti=$(python3 -c "import nvidia.cu13, os; print(os.path.join(nvidia.cu13.__path__[0], 'lib'))" 2>/dev/null)
  trace=("LD_LIBRARY_PATH=$cupti:$LD_LIBRARY_PATH" "CUDA_INJECTION64_PATH=$KERNEL_TIMELINE_SO" KERNEL_TIMELINE_BIN_MS=100)
fi
for round in $(seq 1 "$rounds"); do
  rm -f /tmp/first-process/kt.*
  echo "== round $round ($(date +%T))"
  env "${trace[@]}" KERNEL_TIMELINE_OUT=/tmp/first-process/kt timeout 150 "$lab" bench serve --device cuda --model synthetic:llama8b \
    --cache-dir /tmp/first-process --methods fp16,vq-4 --kv-budget 4GiB --concurrency 32 --capacity-requests 8 \
    > "$out/serve-round$round.txt" 2>&1
  echo "rc $? ($(date +%T))"
  grep -E "N=32|warm-up" "$out/serve-round$round.txt" | cut -c1-200
  for f in /tmp/first-process/kt.*; do
    [ -e "$f" ] || continue
    case $f in *.tmp) continue ;; esac
    { echo "### $f"; cat "$f"; } >> "$out/kernel-timeline-round$round.txt"
  done
done
kill "$clocks" "$sampler"
# Per process: how long it was sampled, what it read from storage meanwhile, how often a thread
# of it waited on the disk.
awk '{ if (!($2 in first)) { first[$2] = $1; r0[$2] = $3; order[++n] = $2 }
       last[$2] = $1; r[$2] = $3; if ($4 > 0) d[$2]++; cmd[$2] = $5 " " $6 " " $7 " " $8 " " $9 " " $10 }
     END { for (i = 1; i <= n; i++) { p = order[i]
       printf "pid %s: %.1f s sampled, %.0f MB read from storage (%.0f MB before), %d samples with a thread in D: %s\n",
         p, last[p] - first[p], (r[p] - r0[p]) / 1e6, r0[p] / 1e6, d[p], cmd[p] } }' "$out/io.txt" | tee "$out/io-summary.txt"
