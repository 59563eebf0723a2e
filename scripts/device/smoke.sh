#!/usr/bin/env bash
# The CUDA smoke check, in one device call: what a user types (`veloq generate --device cuda`) for
# fp16 and VecInfer vq-4 (kernels auto and forbid) and the scalar baselines kivi-2 and rlm-4
# (auto: on CUDA they have only the portable path), with a short prompt and a ~5k-token one, on
# the real SmolLM2; then the kernel tests (veloq-lab's tests/cuda_kernels.rs: quantize, GEMV and
# attention over codes against the CPU path) and the cache conformance suite's CUDA pairs
# (veloq-candle's tests/conformance.rs), both of which fail without a GPU; and fp16 and vq-4
# under compute-sanitizer where the device has it. Run it before
# resolving anything that touches CUDA.
#
#   scripts/device/smoke.sh VELOQ CONFORMANCE_TESTS KERNEL_TESTS MODEL.gguf CALIBRATION TEXT [OUT_DIR]
#
# CALIBRATION is the model's vq-4 calibration (`veloq calibrate --method vq-4`). The binaries are
# built here with --features cuda (see ../shared/DEVICE.md):
#   cargo build --release -p veloq-cli --features cuda --target-dir target-cuda
#   cargo test --release -p veloq-candle --features cuda --target-dir target-cuda --test conformance --no-run
#   cargo test --release -p veloq-lab --features cuda --target-dir target-cuda --test cuda_kernels --no-run
# TEXT is a plain-text novel (scripts/fetch-data); its first ~21,000 characters make the long
# prompt. Every run's output goes to OUT_DIR (default $OUT, else /tmp/veloq-smoke); the script
# exits non-zero if any run fails, produces no tokens, or a conformance test fails.
set -uo pipefail
veloq=$1 conformance=$2 kernels=$3 model=$4 calibration=$5 text=$6
out=${7:-${OUT:-/tmp/veloq-smoke}}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
short="Explain in two sentences why the sky is blue."
long="$(head -c 21000 "$text")

Summarise the passage above in one sentence."
failed=0
summary="$out/smoke-summary.txt"
: > "$summary"
# Start-up: the first process compiles veloq's kernels (NVRTC) into an empty disk cache, the
# second loads them from it (the prefill rate of a short prompt shows the difference).
kernel_cache=$(mktemp -d)
for run in cold warm; do
  start=$(date +%s.%N)
  "$veloq" generate --device cuda --model "$model" --calibration "$calibration" --method vq-4 \
    --kernel-cache "$kernel_cache" --max-tokens 8 --max-context 8192 --prompt "$short" > "$out/startup-$run.txt" 2>&1
  secs=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
  echo "start-up $run: ${secs}s in all, $(ls "$kernel_cache" | wc -l) kernels on disk: $(grep -E '^\[' "$out/startup-$run.txt" | tail -1)" | tee -a "$summary"
done
for run in "fp16 auto" "fp16 forbid" "vq-4 auto" "vq-4 forbid" "kivi-2 auto" "rlm-4 auto"; do
  read -r method kernel_choice <<< "$run"
  for which in short long; do
    prompt=$short
    [ "$which" = long ] && prompt=$long
    log="$out/generate-$method-$kernel_choice-$which.txt"
    start=$(date +%s.%N)
    # Only VecInfer methods take a calibration (the others refuse one by name).
    cal=()
    [[ $method == vq-* ]] && cal=(--calibration "$calibration")
    "$veloq" generate --device cuda --model "$model" "${cal[@]}" --method "$method" \
      --kernels "$kernel_choice" --max-tokens 48 --max-context 8192 --prompt "$prompt" > "$log" 2>&1
    rc=$?
    secs=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
    stats=$(grep -E '^\[' "$log" | tail -1)
    tokens=$(echo "$stats" | sed -nE 's/.*generated ([0-9]+) tok.*/\1/p')
    if [ $rc -ne 0 ] || [ -z "$tokens" ] || [ "$tokens" -lt 1 ]; then
      echo "FAIL  $method $kernel_choice $which (rc $rc): $(tail -3 "$log" | tr '\n' ' ')" | tee -a "$summary"
      failed=1
    else
      echo "ok    $method $kernel_choice $which (${secs}s): $stats" | tee -a "$summary"
      echo "      $(head -c 300 "$log" | tr '\n' ' ')" | tee -a "$summary"
    fi
  done
done
# Memory checks: compute-sanitizer (memcheck) over a ~1k-token prompt and a few decode steps of
# fp16 and vq-4 — the out-of-bounds accesses that only fault now and then under load (a shared
# read past a launch's allocation) fail here every time.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  echo "== compute-sanitizer" | tee -a "$summary"
  medium="$(head -c 4000 "$text")

Summarise the passage above in one sentence."
  for method in fp16 vq-4; do
    cal=()
    [[ $method == vq-* ]] && cal=(--calibration "$calibration")
    log="$out/sanitizer-$method.txt"
    if "$sanitizer" --error-exitcode 99 --print-limit 10 "$veloq" generate --device cuda --model "$model" "${cal[@]}" \
      --method "$method" --kernel-cache "$kernel_cache" --max-tokens 8 --max-context 8192 --prompt "$medium" > "$log" 2>&1; then
      echo "ok    sanitizer $method: $(grep -E 'ERROR SUMMARY' "$log" | tail -1)" | tee -a "$summary"
    else
      echo "FAIL  sanitizer $method: $(grep -E 'Invalid|ERROR SUMMARY| at ' "$log" | head -4 | tr '\n' ' ')" | tee -a "$summary"
      failed=1
    fi
  done
else
  echo "(no compute-sanitizer: memory checks skipped)" | tee -a "$summary"
fi
echo "== kernel tests" | tee -a "$summary"
# A thread per test: they are independent, and the attention test alone sets the time.
if "$kernels" --test-threads 6 > "$out/kernel-tests.txt" 2>&1; then
  grep -E "test result" "$out/kernel-tests.txt" | tee -a "$summary"
else
  grep -E "FAILED|panicked|test result" "$out/kernel-tests.txt" | head -20 | tee -a "$summary"
  failed=1
fi
echo "== conformance suite, CUDA pairs" | tee -a "$summary"
if "$conformance" --test-threads 1 cuda > "$out/conformance-cuda.txt" 2>&1; then
  grep -E "test result" "$out/conformance-cuda.txt" | tee -a "$summary"
else
  grep -E "FAILED|panicked|test result" "$out/conformance-cuda.txt" | head -20 | tee -a "$summary"
  failed=1
fi
[ $failed -eq 0 ] && echo "smoke: all passed" | tee -a "$summary" || echo "smoke: FAILED" | tee -a "$summary"
exit $failed
