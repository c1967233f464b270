# Two commands do all the set-up on a fresh machine (README "Quick start"):
#   make demo   - installs the package and runs the main job (the model demo)
#   make test   - installs the package and runs the test suite (GPU tests skip without a GPU)
PYTHON ?= python3
PYTEST_ARGS ?= -q

.PHONY: setup demo test test-megatron019 bench doctor

# torch first: on a CPU machine without torch, the CPU build (2.13.0) avoids several GB of CUDA
# wheels; where torch is already installed (a GPU machine) it is kept as it is.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[hf,megatron,test,bench]"

demo: setup
	$(PYTHON) -m dsa_plugins demo

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# megatron-core >= 0.17 needs Python >= 3.12: its tests (dsa_plugins as megatron 0.19's DSA backend)
# run in a venv of their own; PyPI's torch for 3.12 is the CUDA build (about 4.7 GB, once)
PYTHON312 ?= $(shell p="$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12"; [ -x "$$p" ] && echo "$$p" || echo python3.12)
VENV312 ?= .venv312
test-megatron019:
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q torch==2.13.0 megatron-core==0.19.2 einops packaging safetensors pytest
	$(VENV312)/bin/python -m pip install -q --no-deps -e .
	$(VENV312)/bin/python -m pytest $(PYTEST_ARGS) tests/adapters/megatron

bench: setup
	$(PYTHON) -m dsa_plugins bench

doctor: setup
	$(PYTHON) -m dsa_plugins doctor
