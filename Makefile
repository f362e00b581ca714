# Everyday commands. `make demo` and `make test` work on a fresh machine (Python 3.11+, a C compiler, cmake).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# llama-cpp-python builds from source: CPU by default. For GPUs see docs/src/install.md (CMAKE_ARGS).
# On x86-64 it is built without llama.cpp's AMX kernels, which segfault on some Sapphire Rapids machines (llama.cpp
# #20824); the weights' other CPU layouts (AVX2/AVX-512 repacking) stay. `make test NO_AMX=` builds them in.
NO_AMX ?= $(if $(filter x86_64 amd64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
# llama.cpp's RPC backend is built in (a model's layers on other machines: `localai rpc-server`, PARAMETER rpc);
# `make test RPC=` leaves it out.
RPC ?= -DGGML_RPC=ON
# `override`: also when CMAKE_ARGS=... is given on make's command line
override CMAKE_ARGS := $(strip $(CMAKE_ARGS) $(RPC) $(NO_AMX))
export CMAKE_ARGS

# make test's suite runs on this many pytest-xdist workers, each file on one worker (its module fixtures start
# once); each worker's llama.cpp contexts get the cores shared out among them (tests/parallel.py). TEST_WORKERS=1:
# one process, as before.
TEST_WORKERS ?= 2

.PHONY: install-dynamo demo newcomer test test-fast test-clients test-gpu llama-server fixtures fixtures-scale bench-scale lint typecheck docs unit install install-test install-agents agents-latest install-clients install-tmux bench stress clean

# pip install that says what it does: each step with how long it usually takes, download and compile progress, a
# line at least every 20 s; pip's whole output (warnings included) goes to the log named on the first line.
INSTALL := $(BIN)/python packaging/install_progress.py

$(BIN)/python:
	@echo "==> Creating the virtualenv $(VENV) and updating pip in it (about 10-30 s)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	@$(INSTALL) --log $(VENV)/install-demo.log --about "localai and the embedded smollm2 model" -- -e '.[demo]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	@$(INSTALL) --log $(VENV)/install-test.log --about "localai and its test tools (MLX, SDKs, mypy, ruff)" -- -e '.[test]'
	@touch $@

install: $(VENV)/.installed-demo
install-test: $(VENV)/.installed-test

## demo: install, start the daemon, answer a prompt with the embedded smollm2 model, show it
demo: install
	@echo "==> Asking smollm2 a question: this starts the localai daemon in the background and loads the model (seconds)"
	$(BIN)/localai run smollm2 "In one sentence: why do coding agents benefit from a prompt cache?"
	@echo "==> What is loaded now"
	$(BIN)/localai ps
	@echo
	@$(BIN)/localai status | head -1
	@echo "The daemon keeps running in the background (smollm2 stays loaded for 5 minutes after its last request)."
	@echo "Stop it with: $(BIN)/localai daemon stop    (\`localai status\` shows it; \`localai tui\` opens the terminal UI)"

# Real coding agents for the `localai launch` end-to-end tests, at the versions pinned in localai/agents/,
# installed once into .agents/ (npm prefix with a Node.js 24 from npm for OpenClaw, plus virtualenvs for Aider
# and Hermes). Needs npm (Node.js >= 18).
AGENTS_DIR := $(CURDIR)/.agents
E2E_AGENTS := claude codex opencode aider qwen cline hermes openclaw pi droid continue

# The installer runs from the source tree in a small virtualenv of its own (the two packages localai.agents.install
# needs beyond the standard library), not localai's: so `make test` runs it while llama.cpp compiles.
AGENTS_INSTALLER := $(AGENTS_DIR)/.installer

$(AGENTS_INSTALLER)/.ready:
	$(PYTHON) -m venv $(AGENTS_INSTALLER)
	$(AGENTS_INSTALLER)/bin/python -m pip install --quiet --disable-pip-version-check platformdirs pyyaml
	@touch $@

$(AGENTS_DIR)/.installed: $(wildcard localai/agents/*.py) | $(AGENTS_INSTALLER)/.ready
	@echo "==> Installing the coding agents the launch tests run ($(E2E_AGENTS)) into .agents/: about 3.3 GB and 5-8 minutes the first time"
	PYTHONPATH=$(CURDIR) LOCALAI_AGENTS_DIR=$(AGENTS_DIR) $(AGENTS_INSTALLER)/bin/python -m localai.agents.install $(E2E_AGENTS)
	@touch $@

ifeq ($(LOCALAI_SKIP_AGENT_E2E),1)
install-agents:
	@echo "LOCALAI_SKIP_AGENT_E2E=1: not installing the agents (their end-to-end tests are skipped)"
else
install-agents: $(AGENTS_DIR)/.installed
endif

## agents-latest: the agents' end-to-end tests against the newest releases npm and PyPI serve today (installed
## into .agents-latest/, not the pinned .agents/), so the release that breaks something is found here first
agents-latest: $(VENV)/.installed-test
	LOCALAI_AGENTS_DIR=$(CURDIR)/.agents-latest LOCALAI_AGENTS_LATEST=1 $(BIN)/python -m localai.agents.install $(E2E_AGENTS)
	LOCALAI_AGENTS_LATEST=1 $(BIN)/python -m pytest -q --durations=0 -p no:cacheprovider tests/agents/test_agents_e2e.py

# The client tier's clients (tests/api/daemon/clients): LangChain, the OpenAI Agents SDK, pydantic-ai, litellm, the llm CLI in
# .clients/python, llama-index (which needs openai<3) in .clients/llama-index, the npm openai and ollama packages in
# tests/api/daemon/clients/node; none of them in the test venv. About a minute on a cold pip cache.
CLIENTS_DIR := $(CURDIR)/.clients

$(CLIENTS_DIR)/.installed: tests/api/daemon/clients/requirements.txt tests/api/daemon/clients/requirements-llama-index.txt tests/api/daemon/clients/node/package.json
	$(PYTHON) -m venv $(CLIENTS_DIR)/python
	$(CLIENTS_DIR)/python/bin/python -m pip install --quiet -r tests/api/daemon/clients/requirements.txt
	$(PYTHON) -m venv $(CLIENTS_DIR)/llama-index
	$(CLIENTS_DIR)/llama-index/bin/python -m pip install --quiet -r tests/api/daemon/clients/requirements-llama-index.txt
	cd tests/api/daemon/clients/node && npm install --no-audit --no-fund --silent
	touch $@

ifeq ($(LOCALAI_SKIP_CLIENTS),1)
install-clients:
	@echo "LOCALAI_SKIP_CLIENTS=1: not installing the client tier's clients (their tests are skipped)"
else
install-clients: $(CLIENTS_DIR)/.installed
endif

# The Dynamo tier (tests/upstreams/daemon/test_dynamo.py): NVIDIA's ai-dynamo 1.6.1 (its real frontend and its CPU
# mocker engine) in a virtualenv of its own, .dynamo/. `pip install ai-dynamo==1.6.1` fails everywhere: it requires
# aisimulate==0.13.0, whose PyPI release is a placeholder that fetches from pypi.nvidia.com; the frontend and the
# mocker do not import it, so the wheel goes in with --no-deps and its other requirements are named here (about a
# minute on a cold pip cache, 0.7 GB, no torch). Linux x86-64 and arm64 only (ai-dynamo-runtime's wheels).
DYNAMO_DIR := $(CURDIR)/.dynamo
DYNAMO_DEPS := ai-dynamo-runtime==1.6.1 "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" \
  "msgspec>=0.19" "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2,<9" tqdm "transformers>=4.56" \
  "typing-extensions>=4.10" "zstandard>=0.23,<1"

$(DYNAMO_DIR)/.installed:
	@echo "==> Installing NVIDIA Dynamo 1.6.1's frontend and mocker into .dynamo/ for the Dynamo tier (about a minute)"
	$(PYTHON) -m venv $(DYNAMO_DIR)
	$(DYNAMO_DIR)/bin/python -m pip install --quiet --disable-pip-version-check $(DYNAMO_DEPS)
	$(DYNAMO_DIR)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps ai-dynamo==1.6.1
	$(DYNAMO_DIR)/bin/python -c "import dynamo.frontend, dynamo.mocker"
	touch $@

ifeq ($(filter x86_64 aarch64,$(shell uname -m))-$(shell uname -s),$(shell uname -m)-Linux)
install-dynamo: $(DYNAMO_DIR)/.installed
else
install-dynamo:
	@echo "ai-dynamo has wheels for Linux x86-64 and arm64 only: not installing it (the Dynamo tier is skipped, saying so)"
endif

# The terminal tier (tests/tui/test_terminal.py) drives `localai tui` in tmux: installed with the system's package
# manager when missing (apt-get as root, as on CI; Homebrew on a Mac), else make test stops here saying so.
install-tmux:
	@command -v tmux >/dev/null || { \
	  echo "==> Installing tmux for the terminal tier (seconds)"; \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq tmux >/dev/null || { apt-get update -qq && apt-get install -y -qq tmux >/dev/null; }; \
	  elif command -v brew >/dev/null; then brew install tmux; \
	  else echo "tmux is missing and cannot be installed here: install it (apt-get install tmux), the terminal tier needs it"; exit 1; fi; }

## test-clients: the client tier alone: every client x check against a real daemon (about 3.5 minutes)
test-clients: install-test install-clients
	$(BIN)/python -m pytest -q -s tests/api/daemon/clients

## test: install everything the tests need (agents and clients included), then lint, type-check and run the suite
## (the preparation runs side by side: the agents' and clients' installs beside llama.cpp's compile into the
## virtualenv, which then takes about 10 minutes on 2 cores instead of 5: unpacking 3.3 GB of agents is CPU work
## too; then the fixtures, lint, the type check and the docs)
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=line install-test install-agents install-clients install-dynamo install-tmux
	@$(MAKE) --no-print-directory -j4 --output-sync=line fixtures lint typecheck docs
	@echo "==> The whole test suite on $(TEST_WORKERS) pytest-xdist workers: about 27 minutes on 2 cores (a dot per test passed, s skipped, F failed)"
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

## test-fast: lint, type-check and the tests that load no model and run no agent (about a minute and a half)
test-fast: install-test lint typecheck
	$(BIN)/python -m pytest -q --durations=10 -m "not model and not agents"

# The GPU tier: llama-cpp-python built for GPU_BACKEND (vulkan or cuda) into a venv of its own (the wheel is built once
# and kept in GPU_WHEELS), then tests/engines/gpu on whatever device llama.cpp finds. Not part of `make test`: the build
# alone takes minutes. Vulkan on a machine without a GPU runs on Mesa's llvmpipe, a CPU-type device that llama.cpp
# skips unless GGML_VK_VISIBLE_DEVICES names it (0 here by default).
GPU_BACKEND ?= vulkan
GPU_VENV ?= .venv-gpu
GPU_WHEELS ?= $(HOME)/.cache/localai/wheels/$(GPU_BACKEND)-rpc
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
test-gpu: $(GPU_VENV)/.installed-$(GPU_BACKEND) fixtures
	GGML_VK_VISIBLE_DEVICES=$(GGML_VK_VISIBLE_DEVICES) $(GPU_VENV)/bin/python -m localai.engines.llama_devices; echo
	GGML_VK_VISIBLE_DEVICES=$(GGML_VK_VISIBLE_DEVICES) GPU_TIER_REQUIRED=1 $(GPU_VENV)/bin/python -m pytest -q -o timeout=900 --durations=10 tests/engines/gpu tests/engines/test_placement.py

## docs: the documentation site (docs/mkdocs.yml, Material for MkDocs; pages in docs/src) into docs/site, --strict:
## a broken link, a missing page or a page left out of the navigation fails it (seconds)
docs: install-test
	@echo "==> mkdocs build --strict (seconds)"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -f docs/mkdocs.yml

lint: install-test
	@echo "==> ruff (seconds)"
	$(BIN)/ruff check localai tests tui packaging

typecheck: install-test
	@echo "==> mypy --strict (about a minute the first time, seconds after)"
	$(BIN)/mypy
	$(BIN)/mypy packaging/install_progress.py

## newcomer: `make demo` in a fresh clone of this commit with a new HOME, checking what its screen says (the install's
## progress lines, the stop hint; not timing). Cold pip cache: llama.cpp compiles, about 10 minutes on 2 cores;
## `make newcomer NEWCOMER_ARGS=--warm-pip-cache` reuses yours (a minute or two). Not part of `make test`.
newcomer:
	$(PYTHON) -m tests.newcomer $(NEWCOMER_ARGS)

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[bench]'
	touch $@

# The speed anchors, built from the llama.cpp that the installed llama-cpp-python vendors (its sdist), with the same
# flags as the project's build (NO_AMX): llama-server and llama-bench in .bench/llama.cpp/build/bin. llama.cpp's
# test-llama-archs, which writes the architecture fixtures (tests/archfixtures.py), is that source's one file
# compiled against the libraries the installed llama-cpp-python already built (libllama exports the model saver
# it calls; libllama-common lands in site-packages/lib): seconds, where building llama.cpp again for it took 2.75
# minutes, and its files are byte for byte the same. Where that link fails (another wheel's layout), cmake builds
# it from the source, unoptimised, in a tree of its own.
LLAMA_ANCHOR := .bench/llama.cpp
LLAMA_VENDORED := $(LLAMA_ANCHOR)/vendored
LLAMA_SOURCE := $(LLAMA_ANCHOR)/.source
LLAMA_CONFIGURED := $(LLAMA_ANCHOR)/.configured
LLAMA_SERVER := $(LLAMA_ANCHOR)/build/bin/llama-server
LLAMA_ARCHS := $(LLAMA_ANCHOR)/fixtures-writer/test-llama-archs
# the installed llama-cpp-python's library folders: llama_cpp/lib, and site-packages/lib for libllama-common
LLAMA_LIB_DIRS = $$($(BIN)/python -c "import llama_cpp, pathlib, sysconfig; \
  print(pathlib.Path(llama_cpp.__file__).parent / 'lib', pathlib.Path(sysconfig.get_paths()['purelib']) / 'lib')")
FIXTURES := .bench/fixtures

$(LLAMA_SOURCE): | $(VENV)/.installed-test
	rm -rf $(LLAMA_ANCHOR)/src $(LLAMA_VENDORED) && mkdir -p $(LLAMA_ANCHOR)/src
	version=$$($(BIN)/python -c "import llama_cpp; print(llama_cpp.__version__)") && \
	  $(PIP) download --quiet --no-deps --no-binary :all: --no-cache-dir -d $(LLAMA_ANCHOR)/src \
	    "llama-cpp-python==$$version" && \
	  tar -xzf $(LLAMA_ANCHOR)/src/llama_cpp_python-$$version.tar.gz -C $(LLAMA_ANCHOR)/src && \
	  ln -s src/llama_cpp_python-$$version/vendor/llama.cpp $(LLAMA_VENDORED)
	touch $@

$(LLAMA_CONFIGURED): $(LLAMA_SOURCE)
	cmake -S $(LLAMA_VENDORED) -B $(LLAMA_ANCHOR)/build \
	    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF $(RPC) $(NO_AMX)
	touch $@

$(LLAMA_SERVER): $(LLAMA_CONFIGURED)
	cmake --build $(LLAMA_ANCHOR)/build --config Release -j $$(nproc) --target llama-server llama-bench

## llama-server: build llama.cpp's own server and llama-bench (the speed anchors) from the vendored source
llama-server: $(LLAMA_SERVER)

$(LLAMA_ARCHS): $(LLAMA_SOURCE)
	@echo "compiling llama.cpp's test-llama-archs (the architecture fixtures' writer) against llama-cpp-python's libraries"
	@mkdir -p $(@D)
	set -- $(LLAMA_LIB_DIRS) && $(CXX) -O0 -std=c++17 $(addprefix -I$(LLAMA_VENDORED)/,common include ggml/include src vendor) \
	    $(LLAMA_VENDORED)/tests/test-llama-archs.cpp -o $@ -L$$1 -L$$2 -lllama-common -lllama -lggml -lggml-base \
	    -Wl,-rpath,$$1 -Wl,-rpath,$$2 || { \
	  echo "could not link it against llama-cpp-python's libraries: building it with cmake (about 2.5 minutes)"; \
	  cmake -S $(LLAMA_VENDORED) -B $(LLAMA_ANCHOR)/build-fixtures \
	    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG=-O0 -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DLLAMA_CURL=OFF \
	    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF $(NO_AMX) && \
	  cmake --build $(LLAMA_ANCHOR)/build-fixtures -j $$(nproc) --target test-llama-archs && \
	  cp $(LLAMA_ANCHOR)/build-fixtures/bin/test-llama-archs $@; }

$(FIXTURES)/.written: tests/archfixtures.py | $(LLAMA_ARCHS)
	TQDM_DISABLE=1 $(BIN)/python -m tests.archfixtures --tool $(LLAMA_ARCHS) \
	  --templates $(LLAMA_VENDORED)/models/templates --out $(FIXTURES)
	touch $@

## fixtures: random-weight models of the architectures agents run on (hybrid, sliding window, MoE, latent attention)
fixtures: $(FIXTURES)/.written

SCALE := $(FIXTURES)/scale

$(SCALE)/.written: tests/scalemodels.py | $(LLAMA_SOURCE)
	$(BIN)/python -m tests.scalemodels --out $(SCALE)
	$(BIN)/python -m tests.scalemodels --out $(SCALE) --name qwen3.5-hybrid --name qwen3.5-moe --quant q4_k \
		--mtp 0.5 --mtp 0.75 --mtp 0.9 --mtp-only
	touch $@

## fixtures-scale: real-shaped random-weight models of six 2026 families, Q8_0 and Q4_K_M-like, and the two Qwen3.5
## ones with an MTP block drafting right on 0.5, 0.75, 0.9 of tokens (tests/scalemodels.py; about 33 GB and 15 minutes
## on 2 cores; for `localai bench`, not part of make test)
fixtures-scale: $(SCALE)/.written

## bench-scale: every path timed on the real-shaped models beside llama-server (tests/scalebench.py; hours on 2 cores:
## `python -m tests.scalebench --name NAME` times one)
bench-scale: $(VENV)/.installed-bench fixtures-scale $(LLAMA_SERVER)
	$(BIN)/python -m tests.scalebench --llama-server $(LLAMA_SERVER)

## bench: prefill/decode through the API, then the interleaved agent trace against llama-cpp-python's server
bench: $(VENV)/.installed-bench
	$(BIN)/localai bench --model smollm2
	$(BIN)/localai bench agents --llama-cpp-python

$(VENV)/.installed-stress: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[stress]'
	touch $@

## stress: the abuse runs with figures (about 35 minutes): security, fuzz, full disk, kill -9 chaos, 64-client load,
## the prompt store's 10-minute concurrency soak, and hostile input (templates that never end, cross-key cache
## guesses, a 1,000-turn stored-responses chain, oversized requests, slow headers and the smaller findings), and a
## long request (200 images, a 20,000-page PDF) beside a chatting client.
## Needs root for the full-disk check (it mounts a small tmpfs); `python -m tests.api.stress --help` for one check.
stress: $(VENV)/.installed-stress
	$(BIN)/python -m tests.api.stress

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(AGENTS_DIR) $(AGENTS_DIR)-latest $(CLIENTS_DIR) tests/api/daemon/clients/node/node_modules
