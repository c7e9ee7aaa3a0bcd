# Two commands a new user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.difftune-installed

.PHONY: setup demo test test-slow test-browser lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the constraint keeps pip from pulling a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/difftune demo --dir demo

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m "slow"

# The web UI in headless Chromium (Debian's `chromium`; skipped when it is not installed).
test-browser: setup
	$(BIN)/python -m pytest -q -m "browser"

lint: setup
	$(BIN)/ruff check src tests

bench: setup
	$(BIN)/python -m difftune.bench

clean:
	rm -rf $(VENV) demo build *.egg-info
