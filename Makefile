# `make demo` and `make test` create .venv from nothing and do their job.
# torch is installed first and pinned by constraints-cpu.txt in every later pip call, so nothing
# pulls a CUDA build on a CPU machine. On a GPU machine, install your torch first and use
# `pip install -e .[test]` directly.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vlmrl demo

# One torch thread per process: the suite starts subprocesses (accelerate, the CLI), and torch
# threads that outnumber the cores spin against each other (10-50x slower on 2 cores).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
