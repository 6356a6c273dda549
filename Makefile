# The two quick-start commands: `make demo` and `make test` (see README.md). Both install into a
# virtual environment of their own, .venv, made with the python3 found here (PY): Debian's python3
# takes no pip install (PEP 668). Every recipe has .venv/bin first on PATH, so the console scripts
# the tests run by name, and `python3`, are the environment's.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
PIP = $(VPY) -m pip install -q --disable-pip-version-check
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test reliability install install-dev lint bench bench-testbed p4 docker-images docker-up docker-logs docker-down docker-run docker-files

# Made once; a half-made one (python3-venv missing: no pip in it) is removed, so that the next
# run makes it again. Remove .venv to start afresh.
$(VPY):
	$(PY) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

install: $(VPY)
	$(PIP) -e .

# torch first, pinned: the CPU wheel; a bare requirement would pull a CUDA build of several GB.
install-dev: $(VPY)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,controller,torch,metrics]"

demo: install
	$(VPY) -m switchagg.demo --workers 4 --size 4000000

test: install-dev
	$(VPY) -m pytest

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
DOCKER_TESTBED = $(PY) docker/testbed.py

docker-images:
	$(DOCKER_TESTBED) images --variant $(VARIANT)

docker-up: docker-images
	$(DOCKER_TESTBED) up -p $(PROJECT) --variant $(VARIANT) -n $(N)

docker-logs:
	$(DOCKER_TESTBED) logs -p $(PROJECT)

docker-down:
	$(DOCKER_TESTBED) down -p $(PROJECT)

# One training run: up, every worker's exit code and log, down.
docker-run: docker-images
	$(DOCKER_TESTBED) run -p $(PROJECT) --variant $(VARIANT) -n $(N)

docker-files:
	$(DOCKER_TESTBED) files
