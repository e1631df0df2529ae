# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on a fresh machine first (scripts/bootstrap.sh; a no-op when up to date).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env test test-fast demo bench lint docs clean

env:
	@bash scripts/bootstrap.sh

test: env
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: env
	$(PY) -m pytest -q -p no:cacheprovider -m "not engine" $(PYTEST_ARGS)

demo: env
	$(PY) examples/demo.py $(DEMO_ARGS)

lint: env
	$(VENV)/bin/ruff check semkv providers adapters tests examples

docs: env  # the documentation site, into site/ (warnings fail the build)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV)
