PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

serve: $(STAMP)
	$(VENV)/bin/batchfit serve --host 127.0.0.1 --port 8000

bench: $(STAMP)
	$(PY) bench/simulate_speed.py

clean:
	rm -rf $(VENV)
