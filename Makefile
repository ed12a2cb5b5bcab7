PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# test-all runs the test files in this many processes (pytest-xdist; a file stays in one process, so that its
# module fixtures, such as a service with workers, start once), and lists the slowest tests.
JOBS ?= 2

.PHONY: test test-fast test-all lint typecheck check serve bench coverage clean

# _allocator.c too: the editable install builds the C replay from it (estimator/replay/native.py refuses a stale one)
$(STAMP): pyproject.toml estimator/replay/_allocator.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Everything: lint, types and every test tier (what CI runs).
test: lint typecheck test-all

# Every test tier: unit, sim, zoo, service (gpu tests skip without a CUDA GPU).
test-all: $(STAMP)
	$(PYTEST) -n $(JOBS) --dist loadfile --durations=25 tests

# The quick loop: unit and small-zoo simulation tests (no full model zoo, no service workers, no slow searches).
test-fast: $(STAMP)
	$(PYTEST) -n $(JOBS) -m "unit or sim" tests

# Before a commit: lint, types and the quick loop.
check: lint typecheck test-fast

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

serve: $(STAMP)
	$(VENV)/bin/batchfit serve --host 127.0.0.1 --port 8000

# The speed benches: one simulation per model, the planner on every card, cold estimates in new processes
# (each prints ratios to a real CPU step measured in the same run).
bench: $(STAMP)
	$(PY) bench/simulate_speed.py
	$(PY) bench/planner_speed.py --skip-every-card
	$(PY) bench/cold_speed.py

# Published fine-tuning figures (LitGPT's 2023 Llama 2 7B LoRA/QLoRA table on an A100-40GB): predicted / published.
published-peft: $(STAMP)
	$(PY) bench/litgpt_tables.py --bnb-2023

# The coverage sweep: every transformers causal/masked/seq2seq-LM and image-classification type and
# 100 seeded timm names, one simulated step each; prints simulates / 422 / fails per task and the failure reasons.
coverage: $(STAMP)
	$(PY) bench/coverage_sweep.py
	BATCHFIT_COVERAGE=all $(PYTEST) tests/test_coverage.py tests/test_hybrid.py

clean:
	rm -rf $(VENV)
