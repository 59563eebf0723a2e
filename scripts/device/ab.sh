#!/usr/bin/env bash
# A kernel change against the binary before it, side by side in one device call: the new binary's
# kernel checks (`veloq-lab bench cuda`, fused and separate merges), then the attention kernels timed
# old/new/old/new on the same grid, the conformance suite's CUDA pairs on the new build, and the
# 8B-geometry decode (`veloq-lab bench runner`, batch 1, graphs, vq-2) old/new/old/new.
#
#   scripts/device/ab.sh LAB_OLD LAB_NEW CONFORMANCE_TESTS [OUT_DIR]
#
# veloq-lab binaries built here with --features cuda (../shared/DEVICE.md; a binary from before
# the lab split is `veloq`, whose `bench` takes the same arguments); OUT_DIR defaults to $OUT. Env:
# AB_BENCH (the `bench cuda` grid), AB_RUNNER (the `bench runner` arguments). Exits non-zero when
# a check or a conformance test fails. Writes ab-checks.txt, ab-kernels.txt, conformance.txt,
# ab-runner.txt and ab-summary.txt.
set -uo pipefail
old=$1 new=$2 conformance=$3
out=${4:-${OUT:-/tmp/veloq-ab}}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
bench=${AB_BENCH:-bench cuda --skip-quantize --kernels tensor-cores --batches 1,8 --contexts 1024,8192,131072 --reps 30}
runner=${AB_RUNNER:-bench runner --models llama8b --model x --calibration x --contexts 1024,131072 --batches 1 --steps 16 --paths graphs}
summary="$out/ab-summary.txt"
failed=0
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee "$summary"
# shellcheck disable=SC2086
if ! "$new" $bench --merge fused,separate > "$out/ab-checks.txt" 2>&1; then
  echo "FAIL: kernel checks (ab-checks.txt)" | tee -a "$summary"
  failed=1
fi
grep -iE "fail|mismatch|error" "$out/ab-checks.txt" | head -20 | tee -a "$summary"
for r in 1 2; do
  for which in old new; do
    bin=$old
    [ "$which" = new ] && bin=$new
    echo "== $which, run $r"
    # shellcheck disable=SC2086
    "$bin" $bench --skip-checks
  done
done > "$out/ab-kernels.txt" 2>&1
grep -E "^==|^\| [0-9]+," "$out/ab-kernels.txt" | tee -a "$summary"
if "$conformance" --test-threads 1 cuda > "$out/conformance.txt" 2>&1; then
  grep -E "test result" "$out/conformance.txt" | tee -a "$summary"
else
  grep -E "FAILED|panicked|test result" "$out/conformance.txt" | head -20 | tee -a "$summary"
  failed=1
fi
for r in 1 2; do
  for which in old new; do
    bin=$old
    [ "$which" = new ] && bin=$new
    echo "== $which, run $r"
    # shellcheck disable=SC2086
    "$bin" $runner 2>&1 || echo "runner failed (rc $?)"
  done
done > "$out/ab-runner.txt" 2>&1
grep -E "^==|failed|ms/step|tok/s" "$out/ab-runner.txt" | head -60 | tee -a "$summary"
[ $failed -eq 0 ] && echo "ab: checks passed" | tee -a "$summary" || echo "ab: FAILED" | tee -a "$summary"
exit $failed
