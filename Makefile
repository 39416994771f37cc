# Two commands for a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
LINT   := src tests $(wildcard benchmarks/*.py)

.PHONY: setup demo test lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/structattn demo

test: setup
	$(VENV)/bin/ruff check $(LINT)
	$(VENV)/bin/ruff format --check $(LINT)
	$(VENV)/bin/mypy
	STRUCTATTN_EXTENSION=require $(PY) -m pytest -rs

# Peers (torch-struct, supar, pytorch-crf) go into a separate venv: never into the test one.
BENCH_VENV ?= .venv-bench

$(BENCH_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q -c constraints.txt -e ".[dev,bench]"
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
