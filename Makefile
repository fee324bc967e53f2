# chunkline: each command does its own set-up on a fresh machine.
#   make demo          install what the demo needs (.venv), then run a server on the default policy with simulated robots
#   make test          install everything (.venv), then run the main test suite
#   make test-lerobot  install LeRobot in a second environment (.venv-lerobot), then run the LeRobot tests
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two installs: the demo's (server, benchmarks, MuJoCo simulation: no torch, jax, ray or atheris;
# the embedded policy then runs on numpy) and everything (make test, lint, dist). The full
# install satisfies the demo's too.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-live test-lerobot test-stress lint install dist bench clean

# LeRobot 0.4.4 (the newest on PyPI) requires torch<2.11 and torchvision<0.26, while this environment
# runs the local CPU build of torch 2.13 (PyPI has no CPU torchvision for it: its wheels link CUDA torch).
# So the LeRobot tests run in a second environment of their own: torch 2.9.1 and torchvision 0.24.1 from
# PyPI (CUDA builds, which run on a CPU), lerobot 0.4.4 with all its dependencies, chunkline editable.
# About two minutes and 8 GB on the first run; then kept (the stamp) until pyproject.toml changes.
LEROBOT_VENV := .venv-lerobot
LEROBOT_PY := $(LEROBOT_VENV)/bin/python
LEROBOT_STAMP := $(LEROBOT_VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[server,bench,sim]"
	touch $(DEMO_STAMP)

# torch first, pinned, the CPU build: from the indexes pip is configured with where they have it
# (this project's machines carry it locally), else from PyTorch's CPU index. PyPI's plain torch
# is the multi-GB CUDA build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet "torch==2.13.0+cpu" 2>/dev/null || \
	  $(PY) -m pip install --quiet "torch==2.13.0+cpu" --index-url $(TORCH_CPU_INDEX)
	$(PY) -m pip install --quiet -e ".[all]"
	touch $(STAMP) $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/chunkline demo

$(LEROBOT_STAMP): pyproject.toml
	test -x $(LEROBOT_PY) || $(PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_PY) -m pip install --quiet --upgrade pip
	$(LEROBOT_PY) -m pip install --quiet "torch==2.9.1" "torchvision==0.24.1"
	$(LEROBOT_PY) -m pip install --quiet "lerobot==0.4.4"
	$(LEROBOT_PY) -m pip install --quiet -e ".[server]" "pytest>=8" "pytest-timeout>=2.3"
	touch $(LEROBOT_STAMP)

# The main suite (its LeRobot tests skip: no lerobot in .venv).
test: $(STAMP)
	$(PY) -m pytest -q -m "not stress"

# Stress runs that repeat a fault many times (50 signals at random start-up points).
test-stress: $(STAMP)
	$(PY) -m pytest -q -m stress

# The LeRobot tests where LeRobot is installed, required there: a missing lerobot fails them
# instead of skipping. CI (.ci/run) runs both.
test-lerobot: $(LEROBOT_STAMP)
	CHUNKLINE_REQUIRE_LEROBOT=1 $(LEROBOT_PY) -m pytest -q -p no:cacheprovider tests/live/test_lerobot_policies.py

# The same suite by kind: unit tests (no process started) and live tests (real servers on loopback).
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not live"

test-live: $(STAMP)
	$(PY) -m pytest -q -m live

# Each top-level folder is installed as chunkline.<folder>: mypy and import-linter read the code
# through a folder of links with those names.
TYPECHECK := .cache/typecheck
lint: $(STAMP)
	$(PY) -m ruff check .
	@mkdir -p $(TYPECHECK)/chunkline && touch $(TYPECHECK)/chunkline/__init__.py
	@for d in client server policies broker safety bench; do ln -sfn ../../../$$d $(TYPECHECK)/chunkline/$$d; done
	cd $(TYPECHECK) && PYTHONPATH=. ../../$(PY) -m mypy --config-file ../../pyproject.toml -p chunkline
	cd $(TYPECHECK) && PYTHONPATH=. ../../$(VENV)/bin/lint-imports ../../pyproject.toml

# The sdist and wheel a release would publish, and their metadata checked (README rendering included).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

bench: $(STAMP)
	$(VENV)/bin/chunkline bench --help

clean:
	rm -rf $(VENV) $(LEROBOT_VENV) .venv-openpi .pytest_cache .hypothesis results .cache/typecheck dist build
