#!/usr/bin/env bash
# The native step loop on the GPU machine (gmtool.kernels.native_loop): its GPU tests (a piecewise entry replays
# natively, bit for bit equal to the Python loop, within tolerance of eager), then the host time per step native vs
# the Python loop vs a full graph (tools/native_loop_timing.py). Everything lands under $OUT.
# Usage, from the repository root: OUT=/some/dir tools/native_loop_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gmtool-out/native-loop}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PYTHONPATH=. "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_native_loop_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
tests=${PIPESTATUS[0]}
PYTHONPATH=. "$PY" tools/native_loop_timing.py --out "$OUT" --tokens 128,512 --iters 100 2>&1 | tee "$OUT/timing.txt"
timing=${PIPESTATUS[0]}
echo "gpu tests rc=$tests, timing rc=$timing; results in $OUT"
exit $((tests | timing))
