# The two quick-start commands: `make demo` and `make test` (see README.md). Both install into a
# virtual environment of their own, .venv, made with the python3 found here (PY): Debian's python3
# takes no pip install (PEP 668). Every recipe has .venv/bin first on PATH, so the console scripts
# the tests run by name, and `python3`, are the environment's.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
PIP = $(VPY) -m pip install -q --disable-pip-version-check
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-fast reliability install install-dev lint bench bench-testbed p4 docker-tools docker-images docker-up docker-logs docker-down docker-run docker-files

# Made once; a half-made one (python3-venv missing: no pip in it) is removed, so that the next
# run makes it again. Remove .venv to start afresh.
$(VPY):
	$(PY) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

install: $(VPY)
	$(PIP) -e .

# torch first, and only if the environment has none (any 2.4+ will do: the one you put there is
# kept). Which build TORCH gives depends on where pip looks: on x86_64 Linux, PyPI's torch is the
# CUDA build (several GB with its nvidia packages). For the CPU build, ask the PyTorch CPU index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (or put a CPU wheel where pip finds it: CI's machines have one through pip's find-links).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
install-dev: $(VPY)
	$(VPY) -c 'import importlib.metadata as m, sys; v = m.version("torch").split("+")[0]; sys.exit(tuple(map(int, v.split(".")[:2])) < (2, 4))' 2>/dev/null \
	  || $(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PIP) -e ".[test,controller,torch,metrics]"
	$(VPY) -m switchagg.torch  # the c10d backend's C++ half, compiled once for this torch (docs/TORCH.md)

demo: install
	$(VPY) -m switchagg.demo --workers 4 --size 4000000

# PYTEST_ARGS: pytest's arguments, e.g. make test PYTEST_ARGS="tests/test_quantize.py -x"
# -rs: the summary says why each skipped test skipped (no root, no bmv2, no Docker engine, ...).
PYTEST_ARGS ?=
test: install-dev
	$(VPY) -m pytest -rs $(PYTEST_ARGS)

# The edit-test loop (tests/ only: bmv2_tests need bmv2): no Docker, no emulated rack (namespaces),
# none of the multi-rank torch runs, the flood, the wheel build or the long idle phases: about 470
# tests, 2.5 min on 2 shared cores (4 min while other suites ran beside it).
FAST_IGNORE = tests/test_docker_testbed.py tests/test_quickstart_debian.py tests/test_testbed.py \
  tests/test_testbed_reducers.py tests/test_reliability_faults.py tests/test_two_level_e2e.py \
  tests/test_torch_stress.py tests/test_torch_training.py tests/test_torch_setup.py \
  tests/test_torch_grad_scaler.py tests/test_torch_backend.py tests/test_foreign_senders.py \
  tests/test_packaging.py tests/test_controller_restart_heartbeats.py tests/test_quiet_runs.py
test-fast: install-dev
	$(VPY) -m pytest -rs tests $(addprefix --ignore=,$(FAST_IGNORE)) $(PYTEST_ARGS)

# The reliability suite: every test marked `reliability` records its row, and docs/RELIABILITY.md is
# rewritten from those rows (tools/reliability_table.py). Root for the emulated-rack rows (namespaces,
# nftables); without bmv2 its rows say skipped and why. Fails if a test failed or a sum was wrong.
RELIABILITY_OUT ?= build/reliability.jsonl
reliability: install-dev
	rm -f $(RELIABILITY_OUT)
	SWITCHAGG_RELIABILITY_OUT=$(RELIABILITY_OUT) $(PY) -m pytest -m reliability -q -rs; status=$$?; \
	$(PY) tools/reliability_table.py $(RELIABILITY_OUT) -o docs/RELIABILITY.md && exit $$status

lint: install-dev
	$(VPY) -m ruff check . && $(VPY) -m ruff format --check . && $(VPY) -m mypy host controller lab bench examples tests bmv2_tests tools docker

bench: install-dev
	$(VPY) bench/bench_allreduce.py

# Root: switchagg vs gloo on an emulated rack with rate-capped links (bench/results/testbed.*).
bench-testbed: install-dev
	$(VPY) bench/bench_testbed.py --train

p4:
	$(MAKE) -C p4

# The docker-compose testbed (docs/DOCKER.md): VARIANT=soft|bmv2, N workers, root, a Docker engine.
# Images stay as a cache after docker-down; everything else (containers, networks, rules) goes.
VARIANT ?= soft
N ?= 4
PROJECT ?= switchagg
# docker/testbed.py runs in .venv too (PyYAML, and pip for the torch wheel): no python3-yaml or
# python3-pip on the host.
DOCKER_TESTBED = $(VPY) docker/testbed.py

docker-tools: $(VPY)
	$(VPY) -c 'import yaml' 2>/dev/null || $(PIP) PyYAML

docker-images: docker-tools
	$(DOCKER_TESTBED) images --variant $(VARIANT)

# TRAIN_BACKEND=gloo, TRAIN_ARGS="--epochs 5": from the environment, as for docker-run.
docker-up: docker-images
	$(DOCKER_TESTBED) up -p $(PROJECT) --variant $(VARIANT) -n $(N)

docker-logs: docker-tools
	$(DOCKER_TESTBED) logs -p $(PROJECT)

docker-down: docker-tools
	$(DOCKER_TESTBED) down -p $(PROJECT)

# One training run: images (built once, by run itself), up, every worker's exit code and log, down.
docker-run: docker-tools
	$(DOCKER_TESTBED) run -p $(PROJECT) --variant $(VARIANT) -n $(N)

docker-files: docker-tools
	$(DOCKER_TESTBED) files
