# The two commands of the README. Each creates .venv if missing and installs the
# project into it (torch pinned to the CPU build 2.13.0 first, so pip does not pull
# a multi-GB CUDA build).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export FP8RL_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: run test venv clean gpu-check gpu-check-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/fp8rl run

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) runs .pytest_cache

# The one GPU script: needs only torch >= 2.11, transformers, pyarrow on the GPU machine;
# torchao travels as a wheel in gpu_check/wheels/ (fetch it here first, where there is network).
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) gpu_check/main.py

gpu-check-wheels:
	mkdir -p gpu_check/wheels
	$(PY) -m pip download --no-deps --only-binary=:all: -d gpu_check/wheels torchao==0.18.0
