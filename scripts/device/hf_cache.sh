#!/usr/bin/env bash
# veloq inside Hugging Face transformers on the H200, one device call: installs the veloq wheel
# built here with CUDA (and the wheels the device lacks), runs the CUDA tests of the Python package
# (python/tests/test_cuda.py), then scripts/device/hf_cache.py (fidelity on SmolLM2; speed and
# memory of VeloqCache against DynamicCache, HQQ's QuantizedCache and StaticCache + torch.compile).
#
#   scripts/device/hf_cache.sh WHEELS_DIR [hf_cache.py options…]
#
# WHEELS_DIR holds the veloq wheel (built here, see ../shared/DEVICE.md:
#   cd python && CARGO_TARGET_DIR=../target-cuda maturin build --release --features cuda --auditwheel skip)
# and the pure-Python wheels to add (gguf, hqq, termcolor, pytest's if missing). Output: $OUT.
set -uo pipefail
wheels=$1
shift
out=${OUT:-/tmp/hf-cache}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
python3 -m pip install --quiet --no-deps --no-index "$wheels"/*.whl 2>&1 | tail -3
python3 -c "import veloq, torch; print('veloq', veloq.__version__, 'torch', torch.__version__)"
status=0
python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda.py 2>&1 | tee "$out/test-cuda.txt" || status=1
python3 scripts/device/hf_cache.py --json "$out/hf-cache-h200.json" "$@" \
  2>&1 | tee "$out/hf-cache-h200.txt" || status=1
exit $status
