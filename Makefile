# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on a fresh machine first (scripts/bootstrap.sh; a no-op when up to date),
# after the system packages the tests need (scripts/system_packages.sh: a Redis with TLS).
VENV ?= .venv
PY := $(VENV)/bin/python
# Two pytest-xdist workers, one core each (tests/conftest.py); a module stays on one worker.
# Tests marked `alone` run afterwards, in one process, with the machine to themselves.
# TEST_WORKERS=0 runs in this process (pytest -n 0).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: env test test-fast test-cuda-build test-gpu demo bench lint docs clean

env:
	@bash scripts/system_packages.sh
	@bash scripts/bootstrap.sh

test: env
	$(PYTEST) $(XDIST) -m "not alone" $(PYTEST_ARGS)
	$(PYTEST) -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS selected none of them

test-fast: env
	$(PYTEST) $(XDIST) -m "not engine" $(PYTEST_ARGS)

# The scheduler-side suite and the namespace tests against every supported CUDA build of vLLM,
# without a GPU: each wheel's Python source (downloaded once, cached under ~/.cache/semkv) over
# .venv (docs/cuda-build.md).
test-cuda-build: env
	VENV=$(VENV) bash scripts/cuda_build_check.sh

# On a GPU machine with the CUDA build of vLLM (pip install "semkv-vllm[gpu]"): semkv's device
# paths in one command (scripts/gpu_check.py; exits 2 where there is no GPU). GPU_PY: that
# environment's Python; the suite runs the same steps on CPU (tests/test_gpu_check.py).
GPU_PY ?= $(PY)
test-gpu:
	$(GPU_PY) scripts/gpu_check.py $(GPU_ARGS)

demo: env
	$(PY) examples/demo.py $(DEMO_ARGS)

lint: env
	$(VENV)/bin/ruff check semkv providers adapters tests examples

docs: env  # the documentation site, into site/ (warnings fail the build)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV)
