# sluice: every target creates and uses the virtual environment at .venv.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install up test lint browser protos model soak chaos compose clean

# Installs exactly the pinned versions (constraints.txt); torch first, so the CPU wheel is taken. Then builds
# the CPU paged attention kernel once (cached; without a C++ compiler it says why and the engine gathers).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m services.engine.executor.kernels.cpu_kernels
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/sluice up

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The chat page's browser test drives Debian's chromium; installed here when missing (needs root).
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	  || echo "warning: could not install chromium: the browser test is skipped outside CI"

# Two pytest runs side by side, each on one torch thread: the tests that start whole stacks (STACK_TESTS) one
# after another as a plain run would, and the other tests beside them, whose output follows at the end.
STACK_TESTS := tests/e2e tests/reliability tests/bench tests/deploy
test: install lint browser
	@SLUICE_TEST_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider $(addprefix --ignore=,$(STACK_TESTS)) $(PYTEST_ARGS) \
	  > $(VENV)/other-tests.log 2>&1 & other=$$!; \
	SLUICE_TEST_THREADS=1 $(PY) -m pytest -q $(STACK_TESTS) $(PYTEST_ARGS); stacks=$$?; \
	wait $$other; others=$$?; echo "== the other tests ($(VENV)/other-tests.log):"; cat $(VENV)/other-tests.log; \
	exit $$(( stacks || others ))

# The soak test for SOAK_S seconds (the suite runs it for 60): 500 concurrent streams a round, every text
# checked, memory and descriptors of each service compared with the warm-up's.
SOAK_S ?= 600
soak: install
	SLUICE_SOAK_S=$(SOAK_S) $(PY) -m pytest -q -s -m soak tests/reliability $(PYTEST_ARGS)

# The fault schedule for CHAOS_S seconds (the suite runs it for 60): stage replicas of a loaded
# `sluice up` killed, stopped and failed at random moments (seed CHAOS_SEED); the JSON summary goes to
# CHAOS_SUMMARY.
CHAOS_S ?= 180
CHAOS_SEED ?= 21
CHAOS_SUMMARY ?= bench-results/chaos-summary.json
chaos: install
	mkdir -p $(dir $(CHAOS_SUMMARY))
	SLUICE_CHAOS_S=$(CHAOS_S) SLUICE_CHAOS_SEED=$(CHAOS_SEED) SLUICE_CHAOS_SUMMARY=$(abspath $(CHAOS_SUMMARY)) \
	  $(PY) -m pytest -q -s -m chaos tests/reliability $(PYTEST_ARGS)

# compose.yaml run for real, in containers (needs root): installs Debian's docker.io, docker-compose 1.29 and
# debootstrap, Compose v2 as the docker CLI plugin, starts dockerd when none runs, builds the image's base
# from Debian's packages (scripts/compose_setup.sh), then builds the image (layers cached between runs) and
# runs the stack under both Compose generations (tests/deploy/test_compose_up.py).
compose: install
	bash scripts/compose_setup.sh
	SLUICE_COMPOSE_TEST=1 $(PY) -m pytest -q -s tests/deploy/test_compose_up.py $(PYTEST_ARGS)

protos: install
	$(PY) scripts/gen_protos.py

model: install
	$(VENV)/bin/sluice model tiny --trained

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
