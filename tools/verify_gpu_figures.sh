#!/usr/bin/env bash
# issue 15's GPU figures for `gmtool verify` (see tools/verify_gpu_figures.py): the dynamic-dimension table, a soak
# per mode under vmm with --check-every 10 (steps/min), and the step at which each injected fault is found.
# Usage on the GPU machine, from the repository root: tools/verify_gpu_figures.sh [--steps 10000 --budget-s 900]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. exec "${PYTHON:-python3}" tools/verify_gpu_figures.py --out "${OUT:-gmtool-out/verify-figures}" "$@"
