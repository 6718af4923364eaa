# The two commands of the README: `make demo` (the main job) and `make test`.
# Both set themselves up: create .venv if missing, install pinned torch first, then the package, every
# dependency at the version pinned in constraints.txt (constraints-verl.txt for .venv-verl).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# verl (gradscope[verl]) pins transformers<5.11: its tests run in a venv of their own.
VERL_VENV  := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_TESTS := tests/integrations/test_verl.py

.PHONY: demo test test-verl bench install clean

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,integrations]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradscope demo

$(VERL_STAMP): pyproject.toml setup.py constraints-verl.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q -c constraints-verl.txt torch==2.13.0
	$(VERL_VENV)/bin/python -m pip install -q -c constraints-verl.txt -e '.[test,verl]'
	touch $(VERL_STAMP)

test: $(STAMP) $(VERL_STAMP)
	$(BIN)/python -m pytest -q --durations=15 --ignore=$(VERL_TESTS)
	$(VERL_VENV)/bin/python -m pytest -q $(VERL_TESTS)

test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q $(VERL_TESTS)

# Benchmarks need the probe's peers (pyproject extra "bench"); BackPACK without its torchvision
# requirement (a CUDA torchvision breaks transformers on CPU torch), see benchmarks/bench_peers.py.
$(VENV)/.bench: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps 'backpack-for-pytorch>=1.6'
	touch $(VENV)/.bench

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info
