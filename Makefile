# realloop: `make demo` runs the main job, `make test` runs the tests; both set up .venv/ first.
VENV := .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup demo test test-all lint bench clean

setup: $(VENV)/.installed

# torch first, pinned: this machine's wheel cache has the CPU build, so pip does not fetch
# the multi-GB CUDA build to satisfy pyproject's torch>=2.6.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# Reference cells as processes and the loop until each is promoted (params.yaml, demo:).
demo: setup
	$(BIN)/realloop demo

# ruff, then the architecture contracts (pyproject's [tool.importlinter]), then the tests.
test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q -m "not slow"

# Adds the slow checks: e.g. triage precision on a 1,000-episode shift (needs models/sim-policy).
test-all: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m bench.refcell
	$(BIN)/python -m bench.loop

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
