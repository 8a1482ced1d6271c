# gmtool: set-up, tests, GPU checks and benchmarks.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
OUT ?= gmtool-out

.PHONY: setup run test test-wheel test-gpu mutants bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	# torch==2.13.0 takes the CPU build on these machines; a bare 'torch' would pull a multi-GB CUDA build
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	# the test extra brings Triton, required: on the CPU its interpreter runs the kernel tests
	# (tests/test_kernels.py, tests/test_layer_kernels.py), which fail rather than skip without it
	$(VPY) -m pip install -q -e '.[test]'

setup: $(VPY)

# The main job on a built-in default: qwen3-0.6b on CUDA, tiny-qwen3 on the CPU tape backend.
run: setup
	$(VENV)/bin/gmtool capture

test: setup
	$(VENV)/bin/ruff check gmtool tests tools
	$(VENV)/bin/ruff format --check gmtool tests tools
	# one worker per core (at most 4), one torch thread each: the workers would fight over cores otherwise
	GMTOOL_CPU_THREADS=1 $(VPY) -m pytest -q -m "not gpu" -n auto --maxprocesses 4

# The package as users get it: the wheel built, installed into a fresh virtual environment in a temporary
# directory (torch==2.13.0 from this machine's disk, as in set-up; --no-compile: no bytecode for all of torch),
# then `gmtool capture` on its default model and buckets (fewer timed iterations), run from outside the tree; it
# must exit 0 and write results.json; then `gmtool plan` on a built-in workload from those results (the wheel's
# copy of profiles/workloads). The temporary directory is removed after.
test-wheel:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" wheel -qq --no-deps -w "$$tmp/dist" .; \
	"$$tmp/venv/bin/pip" install -qq --no-compile torch==2.13.0 "$$tmp"/dist/gmtool-*.whl; \
	cd "$$tmp"; venv/bin/gmtool capture --device cpu --out run --num-iters 3 --num-iters-warmup 1; \
	test -s run/results.json; venv/bin/gmtool plan --workload chat --from run --out plan; test -s plan/plan.json; \
	echo "test-wheel: the installed wheel ran gmtool capture and plan from $$tmp"

# Targeted mutants of the correctness paths (tools/mutants.py): each must make a test fail.
# ARGS: e.g. ARGS="-j 2", ARGS="--only relerr-mean", ARGS="--list", ARGS="--markdown mutants.md".
mutants: setup
	$(VPY) tools/mutants.py $(ARGS)

# GPU machine: no install there; run from the tree with its own python3.
test-gpu:
	PYTHONPATH=. $(PY) -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider

bench:
	PYTHONPATH=. $(PY) -m gmtool.cli.main bench --out $(OUT)/bench

clean:
	rm -rf $(VENV) gmtool-out .pytest_cache
