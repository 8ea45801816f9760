# `make demo`, `make test` and `make docs` create .venv from nothing and do their job.
# torch is installed first, and constraints-cpu.txt pins it and the rest of the stack (the versions
# `make test` passed with) in every later pip call, so nothing pulls a CUDA build on a CPU machine.
# On a GPU machine, install your torch first, then the same pins without torch's line
# (docs/install.md).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow docs install clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints-cpu.txt torch  # first, alone: the CPU build on disk
	$(PIP) install --quiet -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vlmrl demo

# One torch thread per process: the suite starts subprocesses (accelerate, the CLI), and torch
# threads that outnumber the cores spin against each other (10-50x slower on 2 cores).
# TEST_WORKERS pytest processes (pytest-xdist) share the tests: most of the suite's time is Python
# starting and importing torch in one process while the other core idles (2 workers: 6.3 min
# against 11.4 in one on the 2-core machine). TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow

# The manual as a site in site/ (mkdocs, Material theme); `make test` builds it too, with --strict.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs site .pytest_cache
