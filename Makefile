# Two commands do all the set-up on a fresh machine (README "Quick start"):
#   make demo   - installs the package and runs the main job (the model demo)
#   make test   - installs the package and runs the test suite (GPU tests skip without a GPU)
PYTHON ?= python3
PYTEST_ARGS ?= -q

.PHONY: setup demo test bench doctor

# torch first: on a CPU machine without torch, the CPU build (2.13.0) avoids several GB of CUDA
# wheels; where torch is already installed (a GPU machine) it is kept as it is.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[hf,megatron,test,bench]"

demo: setup
	$(PYTHON) -m dsa_plugins demo

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PYTHON) -m dsa_plugins bench

doctor: setup
	$(PYTHON) -m dsa_plugins doctor
