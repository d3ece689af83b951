# Shortcuts for the usual commands; each runs inside .venv (created by `make setup`).
# Pass Hydra overrides or pytest arguments with ARGS, e.g.
#   make train ARGS="experiment=mnist1d_cnn parallel=ddp"
#   make test ARGS="-k summarize -x"

VENV ?= .venv
PYTHON := $(VENV)/bin/python
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup train test test-fast lint format benchmark tensorboard clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup:  ## create .venv (if missing) and install hydraloop with its dev and vision extras (idempotent)
	bash scripts/setup.sh

train:  ## one training run: make train ARGS="experiment=mnist1d_cnn"
	$(PYTHON) src/train.py $(ARGS)

test:  ## the whole test suite, as CI runs it (after setup)
	bash scripts/test.sh $(ARGS)

test-fast:  ## the fast tier, after each change: configs, experiments' first steps, one ddp/fsdp-equals-single, bad input
	$(PYTHON) -m pytest -m fast -n 2 --dist worksteal $(ARGS)

lint:  ## ruff lint and format check (no changes)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:  ## sort imports and format with ruff (changes files)
	$(VENV)/bin/ruff check --select I --fix .
	$(VENV)/bin/ruff format .

benchmark:  ## throughput and start-up benchmark (scripts/benchmark.py)
	$(PYTHON) scripts/benchmark.py $(ARGS)

tensorboard:  ## TensorBoard over every run in outputs/
	$(VENV)/bin/tensorboard --logdir outputs $(ARGS)

clean:  ## remove outputs/ (all runs!) and Python, pytest and ruff caches; keeps .venv and the data cache
	rm -rf outputs multirun .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +
