# The two quick-start commands: `make demo` and `make test` (see README.md).
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test install install-dev lint bench bench-testbed p4 docker-images docker-up docker-logs docker-down docker-run docker-files

install:
	$(PIP) -e .

# torch first, pinned: the CPU wheel; a bare requirement would pull a CUDA build of several GB.
install-dev:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,controller,torch,metrics]"

demo: install
	$(PY) -m switchagg.demo --workers 4 --size 4000000

test: install-dev
	$(PY) -m pytest

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy host controller bench examples tests bmv2_tests tools docker

bench: install-dev
	$(PY) bench/bench_allreduce.py

# Root: switchagg vs gloo on an emulated rack with rate-capped links (bench/results/testbed.*).
bench-testbed: install-dev
	$(PY) bench/bench_testbed.py --train

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
