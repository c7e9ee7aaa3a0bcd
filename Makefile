# Two commands a new user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.difftune-installed

.PHONY: setup demo test test-gpu test-slow test-browser test-ui lint bench bench-memory bench-tread bench-gpu bench-host-optimizer plan-calibrate clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@# the pins in constraints.txt (diffusers 0.42, numpy 2.4, pandas 3) need Python 3.11 or newer
	@$(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else \
		f"make needs Python 3.11 to 3.13 (constraints.txt pins releases that need 3.11); this is {sys.version.split()[0]}. " \
		"Run make PYTHON=python3.11 (or 3.12, 3.13); on Python 3.10, pip install -e . picks releases that still support it.")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the constraint keeps pip from pulling a CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/difftune demo --dir demo

# Test files spread over the CPU's cores (at most 4 workers; a file stays on one worker, so its module fixtures are
# built once; each worker gets its share of the cores, tests/conftest.py): 2 cores take ~8 min instead of ~15.
test: setup
	$(BIN)/python -m pytest -q -m "not slow" -n auto --maxprocesses 4 --dist loadfile

# On a GPU machine: the CUDA-only tests and the user's path (bf16, validation, spec configs, streaming) on CUDA,
# then the features whose tensors move between devices (first group: run on an H100 on 2026-11-24).
test-gpu: setup
	$(BIN)/python -m pytest -q -m "not slow" tests/test_gpu.py tests/test_bf16.py tests/test_spec_configs.py \
		tests/test_offload.py tests/test_tread.py
	$(BIN)/python -m pytest -q -m "not slow" tests/test_crepa.py tests/test_quantization.py tests/test_dora.py \
		tests/test_ema.py tests/test_prefetch.py tests/test_masked_loss.py tests/test_eval_loss.py \
		tests/test_regularisation.py tests/test_model_offload.py

test-slow: setup
	$(BIN)/python -m pytest -q -m "slow"

# The web UI in headless Chromium (Debian's `chromium`; skipped when it is not installed).
test-browser: setup
	$(BIN)/python -m pytest -q -m "browser"

# The web UI without a browser: its API, its hardening, and the long seeded fuzz of every route.
test-ui: setup
	$(BIN)/python -m pytest -q tests/test_ui_api.py tests/test_ui_hardening.py tests/test_ui_fuzz.py

lint: setup
	$(BIN)/ruff check src tests

bench: setup
	$(BIN)/python -m difftune.bench

# Weight bytes per base_model_precision at real size (random init, CPU; BENCHMARKS.md, issue 13).
bench-memory: setup
	$(BIN)/python -m difftune.bench_memory

# Step time with and without TREAD at real width (random init, CPU, minutes; BENCHMARKS.md, issue 15).
bench-tread: setup
	$(BIN)/python -m difftune.bench_tread

# LoRA steps of the real-size transformers on a GPU: step time, peak memory, MFU per attention backend, with and
# without compile and checkpointing (random init, no download; BENCHMARKS.md, issue 17). Needs a CUDA device.
bench-gpu: setup
	$(BIN)/python -m difftune.bench_gpu

# How fast each optimizer steps on the CPU: the cost of optimizer_cpu_offload_method 'cpu' (BENCHMARKS.md).
bench-host-optimizer: setup
	$(BIN)/python -m difftune.bench_host_optimizer

plan-calibrate: setup  # re-measure src/difftune/memory_plan/coefficients.py (CPU, minutes)
	$(BIN)/python -m difftune.memory_plan.measure

clean:
	rm -rf $(VENV) demo build *.egg-info
