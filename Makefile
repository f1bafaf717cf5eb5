# Everything sets itself up: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE_STAMP := $(VENV)/.installed-base
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench-quantize bench-convert clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(BASE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

# The oracle extra pins torch==2.13.0, the CPU build these machines provide locally.
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test,oracle,serve]'
	touch $(BASE_STAMP) $@

demo: $(BASE_STAMP)
	$(BIN)/colibri demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

bench-quantize: $(BASE_STAMP)
	$(BIN)/python bench/quantize.py

bench-convert: $(BASE_STAMP)
	$(BIN)/python bench/convert.py

clean:
	rm -rf $(VENV) demo-out bench/out .pytest_cache
