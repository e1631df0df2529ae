# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on a fresh machine first (scripts/bootstrap.sh; a no-op when up to date).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env test test-fast test-cuda-build demo bench lint docs clean

env:
	@bash scripts/bootstrap.sh

test: env
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: env
	$(PY) -m pytest -q -p no:cacheprovider -m "not engine" $(PYTEST_ARGS)

# The scheduler-side suite and the namespace tests against the CUDA build of the newest
# supported vLLM, without a GPU: its wheel's Python source (downloaded once, cached under
# ~/.cache/semkv) over .venv (docs/cuda-build.md).
test-cuda-build: env
	VENV=$(VENV) bash scripts/cuda_build_check.sh

demo: env
	$(PY) examples/demo.py $(DEMO_ARGS)

lint: env
	$(VENV)/bin/ruff check semkv providers adapters tests examples

docs: env  # the documentation site, into site/ (warnings fail the build)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV)
