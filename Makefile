# The two commands: `make train` and `make test`. The first target run creates .venv and installs into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CH ?= 01
ARGS ?=
# CPU build of torch where there is no NVIDIA driver (it lies on disk on the course's CI machines);
# the normal (CUDA) build where there is one.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: help setup train test test-fast test-unit lab book grade lint bench clean

help:
	@echo "make train            train the default model, Llama form (2 CPU ranks, or one rank per GPU)"
	@echo "make test             the whole suite: unit, multi-rank, notebooks (nbval), exercise self-check"
	@echo "make lab              open the course in JupyterLab (the repository root, chapter 00 open)"
	@echo "make book [ONLY=00]   the executed course as static HTML in build/book/ (index.html: the course map)"
	@echo "make grade CH=NN      grade your solution of exercises/NN_*.py"
	@echo "make test-fast        the suite without the notebooks"
	@echo "make test-unit        the tests that start no process (about 23 s on 2 idle cores: the edit loop)"
	@echo "make lint             ruff check, mypy over refimpl/"
	@echo "make bench            run every benchmark (tables to record in bench/RESULTS.md)"

$(STAMP): pyproject.toml lab/overrides.json
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	@# JupyterLab reads the environment's overrides: a double-click on a chapter opens it as a notebook
	mkdir -p $(VENV)/share/jupyter/lab/settings
	cp lab/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $(STAMP)

setup: $(STAMP)

# The default run trains the Llama form with grouped-query attention (TRAIN_ARGS="--arch gpt2": GPT-2's) and,
# without ARGS, demonstrates elastic restart (the trainer's default run, README)
TRAIN_ARGS ?= --arch llama --num-kv-heads 2
train: $(STAMP)
	$(PY) -m refimpl.train --nproc-per-node auto $(TRAIN_ARGS) $(if $(ARGS),,--demo-fault) $(ARGS)

# Two lanes at once (tools/run_tests.py): the computing tests, and beside them those that mostly wait,
# then the slowest chapters (marked lane2)
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) tools/run_tests.py --durations=15 $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/course/chapters/test_chapters.py $(ARGS)

# tests/conftest.py gives the markers, by folder: pytest -m "not spawn and not subprocess and not chapter
# and not browser", the modules of those tiers not even collected (tools/run_tests.py, unit_command)
test-unit: $(STAMP)
	$(PY) tools/run_tests.py --unit $(ARGS)

# At the repository root (refimpl/ and exercises/ one click away), the first chapter open: with a file
# alone, Lab would serve the file's folder. JupyterLab refuses to run as root without --allow-root: in a
# container we are root. ARGS go to Lab: tests/course/browser/serial/test_browser.py starts Lab through this target (make lab
# ARGS="--no-browser --ServerApp.port=..."), so that the command tested is this one.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,) $(ARGS) \
		chapters/00_orientation.py

# Every chapter executed (a fresh kernel each) and rendered to HTML; ONLY="00 03" builds a subset.
book: $(STAMP)
	$(PY) tools/book.py $(if $(ONLY),--only $(ONLY),)

grade: $(STAMP)
	$(PY) -m exercises.grade $(CH)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	@set -e; for b in bench/bench_*.py; do m=$${b%.py}; echo "== $$m"; $(PY) -m $${m//\//.}; done

clean:
	rm -rf build runs .pytest_cache chapters/.build
