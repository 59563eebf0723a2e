#!/usr/bin/env bash
# CUDA-graph decode (issue 18) in one device call, stages chosen by STAGES (default all five):
#   generate: what a user types, `veloq generate --device cuda` with graphs off
#             (VELOQ_CUDA_GRAPHS=0, the path before them) and on, every method, a short and a
#             ~5k-token prompt, and `--weights f32`; the two texts must be equal;
#   f16w:     f16 weights (the GEMV's path, fused layer): GEMV on and off, every method, and
#             `bench runner` on them (batch 8 through tensor cores against cuBLAS);
#   runner:   the kernel checks (`veloq-lab bench cuda --check-only`), then `veloq-lab bench runner` on
#             the real SmolLM2 (agreement CPU/CUDA and graphs/eager, decode speed; SMOL_ARGS);
#   runner8b: the GEMV's launch shapes timed on the 8B layer's matrices (`veloq-lab bench cuda
#             --gemv-sweep`, the fastest exported as VELOQ_GEMV / VELOQ_GEMV_MMA; SWEEP=0 skips
#             it), then `veloq-lab bench runner` on the
#             random 8B geometry: decode on every path side by side, the bytes floor at the copy
#             bandwidth measured in the same run, memory budget;
#   hf:       the anchor, Hugging Face transformers + torch.compile(mode="reduce-overhead") on the
#             same random 8B geometry (scripts/device/hf_decode.py).
#
#   scripts/device/graphs.sh VELOQ MODEL.gguf CALIBRATION TEXT OUT_DIR [extra bench runner args]
#
# VELOQ is built here with --features cuda (../shared/DEVICE.md), veloq-lab beside it (or
# $VELOQ_LAB); CALIBRATION is the vq-4 one. Exits non-zero when a run
# fails or graphs change a text.
set -uo pipefail
veloq=$1 model=$2 cal=$3 text=$4 out=$5
shift 5
lab=${VELOQ_LAB:-$(dirname "$veloq")/veloq-lab}
stages=${STAGES:-generate f16w runner runner8b hf}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export VELOQ_FONT=${VELOQ_FONT:-.device/DejaVuSans.ttf}
short="Explain in two sentences why the sky is blue."
long="$(head -c 21000 "$text")

Summarise the passage above in one sentence."
failed=0
summary="$out/graphs-summary.txt"
: > "$summary"
# Per-run logs go to one archive ($OUT brings back a few files only).
logs=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"

if [[ " $stages " == *" generate "* ]]; then
  for run in "fp16" "vq-4" "kivi-2" "rlm-4" "fp16 --weights f32" "vq-4 --weights f32"; do
    for which in short long; do
      prompt=$short
      [ "$which" = long ] && prompt=$long
      tag=$(echo "$run $which" | tr -cs 'a-z0-9' '_' | sed 's/_$//')
      for g in 0 1; do
        # shellcheck disable=SC2086
        VELOQ_CUDA_GRAPHS=$g "$veloq" generate --device cuda --model "$model" --calibration "$cal" --method $run \
          --max-tokens 48 --max-context 8192 --prompt "$prompt" > "$logs/gen-$tag-g$g.txt" 2>&1
        echo $? > "$logs/gen-$tag-g$g.rc"
      done
      stats0=$(grep -E '^\[' "$logs/gen-$tag-g0.txt" | tail -1)
      stats1=$(grep -E '^\[' "$logs/gen-$tag-g1.txt" | tail -1)
      if [ "$(cat "$logs/gen-$tag-g0.rc")" != 0 ] || [ "$(cat "$logs/gen-$tag-g1.rc")" != 0 ] || [ -z "$stats1" ]; then
        echo "FAIL  $run $which: $(tail -3 "$logs/gen-$tag-g1.txt" | tr '\n' ' ')" | tee -a "$summary"
        failed=1
      elif diff <(grep -vE '^\[' "$logs/gen-$tag-g0.txt" | grep -v '^veloq:') <(grep -vE '^\[' "$logs/gen-$tag-g1.txt" | grep -v '^veloq:') > /dev/null; then
        echo "same  $run $which | eager: $stats0 | graphs: $stats1" | tee -a "$summary"
      else
        echo "DIFF  $run $which | eager: $stats0 | graphs: $stats1" | tee -a "$summary"
        failed=1
      fi
      grep '^veloq:' "$logs/gen-$tag-g1.txt" | head -2 | tee -a "$summary"
    done
  done
  # f16 weights (--weights f16): veloq's GEMV against cuBLAS, graphs on.
  # Different arithmetic (f32 activations in the GEMV, f16 in cuBLAS): a text may part at a
  # near-tie, reported, not failed.
  for m in fp16 vq-4; do
    for g in 0 1; do
      "$veloq" generate --device cuda --weights f16 --cuda-gemv $g --model "$model" --calibration "$cal" \
        --method $m --max-tokens 48 --max-context 8192 --prompt "$short" > "$logs/gen-f16w-$m-gemv$g.txt" 2>&1 || failed=1
    done
    same=$(diff <(grep -vE '^\[' "$logs/gen-f16w-$m-gemv0.txt") <(grep -vE '^\[' "$logs/gen-f16w-$m-gemv1.txt") > /dev/null && echo same || echo differs)
    echo "f16 weights, $m: GEMV vs cuBLAS text $same | cuBLAS: $(grep -E '^\[' "$logs/gen-f16w-$m-gemv0.txt" | tail -1) | GEMV: $(grep -E '^\[' "$logs/gen-f16w-$m-gemv1.txt" | tail -1)" | tee -a "$summary"
  done
  echo "one text: $(head -c 300 "$logs/gen-vq_4_short-g1.txt" | tr '\n' ' ')" | tee -a "$summary"
fi

if [[ " $stages " == *" f16w "* ]]; then
  # f16 weights (--weights f16), the path veloq's GEMV takes (norms, RoPE,
  # residual adds and the gated MLP fused into four launches a layer): GEMV on and off (cuBLAS,
  # candle's norms and RoPE), every method, short and long prompts. Different arithmetic (f32
  # activations in the one-row GEMV, f16 in cuBLAS): a text may part at a near-tie, reported.
  for run in "fp16" "vq-4" "kivi-2" "rlm-4"; do
    for which in short long; do
      prompt=$short
      [ "$which" = long ] && prompt=$long
      tag=$(echo "$run $which" | tr -cs 'a-z0-9' '_' | sed 's/_$//')
      for g in 0 1; do
        # shellcheck disable=SC2086
        "$veloq" generate --device cuda --weights f16 --cuda-gemv $g --model "$model" --calibration "$cal" \
          --method $run --max-tokens 48 --max-context 8192 --prompt "$prompt" > "$logs/gen-f16w-$tag-gemv$g.txt" 2>&1
        echo $? > "$logs/gen-f16w-$tag-gemv$g.rc"
      done
      s0=$(grep -E '^\[' "$logs/gen-f16w-$tag-gemv0.txt" | tail -1)
      s1=$(grep -E '^\[' "$logs/gen-f16w-$tag-gemv1.txt" | tail -1)
      if [ "$(cat "$logs/gen-f16w-$tag-gemv0.rc")" != 0 ] || [ "$(cat "$logs/gen-f16w-$tag-gemv1.rc")" != 0 ] || [ -z "$s1" ]; then
        echo "FAIL  f16 weights, $run $which: $(tail -3 "$logs/gen-f16w-$tag-gemv1.txt" | tr '\n' ' ')" | tee -a "$summary"
        failed=1
      else
        t0=$(grep -vE '^\[' "$logs/gen-f16w-$tag-gemv0.txt" | grep -v '^veloq:')
        t1=$(grep -vE '^\[' "$logs/gen-f16w-$tag-gemv1.txt" | grep -v '^veloq:')
        same=$([ "$t0" = "$t1" ] && echo "same   " || echo "differs")
        echo "$same f16 weights, $run $which | cuBLAS: $s0 | GEMV: $s1" | tee -a "$summary"
        [ "$same" = differs ] && { echo "  cuBLAS: ${t0:0:200}"; echo "  GEMV:   ${t1:0:200}"; } | tee -a "$summary"
      fi
    done
  done
  # Batches on the real weights in f16: veloq's GEMV (tensor cores from 2 rows) + graphs against
  # cuBLAS eager, and decode speed.
  "$lab" bench runner --weights f16 --model "$model" --calibration "$cal" --method vq-4 --models smollm2 \
    --contexts 1024 --batches 1,8 --steps 12 --agree-tokens 32 --json "$out/bench-runner-smollm2-f16w-h200.json" \
    > "$logs/bench-runner-smollm2-f16w-h200.txt" 2>&1 || { echo "FAIL  bench runner smollm2 f16 weights (rc $?)" | tee -a "$summary"; failed=1; }
  grep -E "greedy|batch|tok/s|graphs|eager|rror" "$logs/bench-runner-smollm2-f16w-h200.txt" | tee -a "$summary"
fi

if [[ " $stages " == *" runner "* ]]; then
  # Kernel checks first (quantize, attention, GEMV against host references).
  "$lab" bench cuda --check-only > "$logs/bench-cuda-checks.txt" 2>&1 || { echo "FAIL  kernel checks" | tee -a "$summary"; failed=1; }
  grep -E "gemv|GEMV|FAIL|rror" "$logs/bench-cuda-checks.txt" | head -5 | tee -a "$summary"
  # The real SmolLM2 (agreement: CPU vs CUDA, graphs vs eager) with its own arguments, then the
  # 8B geometry with the script's extra arguments.
  # shellcheck disable=SC2086
  "$lab" bench runner --model "$model" --calibration "$cal" --method vq-4 --models smollm2 ${SMOL_ARGS:---contexts 1024 --batches 1,8} \
    --json "$logs/bench-runner-graphs-smollm2-h200.json" > "$logs/bench-runner-graphs-smollm2-h200.txt" 2>&1 \
    || { echo "FAIL  bench runner smollm2 (rc $?)" | tee -a "$summary"; failed=1; }
  grep -E "greedy|tok/s|graphs|eager" "$logs/bench-runner-graphs-smollm2-h200.txt" | tee -a "$summary"
fi

if [[ " $stages " == *" runner8b "* ]]; then
  # The GEMV's launch shapes on the 8B layer's matrices; the fastest is what the runner uses
  # (SWEEP=0: the built-in defaults, the sweep run in another call).
  if [ "${SWEEP:-1}" != 0 ]; then
    "$lab" bench cuda --gemv-sweep --skip-checks > "$out/gemv-sweep-h200.txt" 2>&1 || { echo "FAIL  GEMV sweep" | tee -a "$summary"; failed=1; }
    grep -E "^copy|^best" "$out/gemv-sweep-h200.txt" | tee -a "$summary"
    best=$(sed -nE 's/^best VELOQ_GEMV=([0-9]+,[0-9]+,[0-9]+).*/\1/p' "$out/gemv-sweep-h200.txt")
    [ -n "$best" ] && export VELOQ_GEMV=$best
    best=$(sed -nE 's/^best VELOQ_GEMV_MMA=([0-9]+,[0-9]+,[0-9]+).*/\1/p' "$out/gemv-sweep-h200.txt")
    [ -n "$best" ] && export VELOQ_GEMV_MMA=$best
  fi
  "$lab" bench runner --model "$model" --calibration "$cal" --models llama8b \
    --json "$out/bench-runner-graphs-h200.json" --plot "$out/bench-runner-graphs-h200.png" "$@" \
    > "$out/bench-runner-graphs-h200.txt" 2>&1 || { echo "FAIL  bench runner (rc $?)" | tee -a "$summary"; failed=1; }
  tail -n 60 "$out/bench-runner-graphs-h200.txt"
fi

if [[ " $stages " == *" hf "* ]]; then
  # shellcheck disable=SC2086
  python3 scripts/device/hf_decode.py --json "$out/hf-decode-h200.json" ${HF_ARGS:-} 2>&1 \
    | grep -vE '^W[0-9]{4} |Warning|warn\(' | tee "$out/hf-decode-h200.txt" | tail -n 20
  # The anchor beside veloq's lines in the runner's figure.
  if [ -f "$out/bench-runner-graphs-h200.json" ]; then
    "$lab" bench runner --replot "$out/bench-runner-graphs-h200.json" --anchor "$out/hf-decode-h200.json" \
      --plot "$out/bench-runner-graphs-h200.png" || true
  fi
fi
tar czf "$out/logs.tgz" -C "$logs" .
exit $failed
