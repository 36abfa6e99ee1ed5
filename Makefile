# One venv, built from scratch by `make venv`; every other target depends on it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The demo needs only the core (pip install -e .); its own stamp, so `make test` after `make demo`
# still installs the extras into the same venv.
CORE    := $(VENV)/.core
PIP     := $(BIN)/pip --disable-pip-version-check
# torch 2.13.0 has a CPU wheel on this machine's disk; plain `torch` would pull a CUDA build.
EXTRAS  ?= test,torch,mooncake,dev

.PHONY: venv demo test bench lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q -U pip

$(CORE): pyproject.toml | $(BIN)/python
	$(PIP) install -q -e .
	touch $(CORE)

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install -q "torch==2.13.0" -e ".[$(EXTRAS)]"
	touch $(STAMP) $(CORE)

venv: $(STAMP)

demo: $(CORE)
	$(BIN)/gpuhit replay

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/perf

lint: $(STAMP)
	$(BIN)/ruff check gpuhit gateway replayer policies engines analysis tests

clean:
	rm -rf $(VENV) results .pytest_cache
