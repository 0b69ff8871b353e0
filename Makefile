# realloop: `make demo` runs the main job, `make test` runs the tests; both set up .venv/ first.
VENV := .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup demo test test-all test-services test-faults services lint bench clean

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
	$(BIN)/pytest -q -m "not slow and not services and not faults"

# Adds the slow checks: e.g. triage precision on a 1,000-episode shift (needs models/sim-policy).
test-all: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q -m "not services and not faults"

# The production profile (PostgreSQL, Prefect and MLflow servers, S3 store, workers) end to end;
# needs Debian's postgresql package (`apt-get install -y postgresql`).
test-services: setup
	$(BIN)/pytest -q -m services

# The fault suite (tests/faults): workers killed, PostgreSQL restarted, MLflow and S3 down,
# two loops at once, against one production profile on loopback; needs postgresql.
test-faults: setup
	$(BIN)/pytest -q -m faults tests/faults

# The production profile on this machine; `$(BIN)/realloop services down` stops it.
services: setup
	$(BIN)/realloop services up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m bench.refcell
	$(BIN)/python -m bench.loop

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
