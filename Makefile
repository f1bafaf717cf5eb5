# Everything sets itself up: `make demo` and `make test` work on a fresh clone.
# Installs come from the hashed locks in locks/ (`make lock` rewrites them from pyproject.toml);
# `make test-latest` runs the suite on the newest releases instead, to see drift on purpose.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE_STAMP := $(VENV)/.installed-base
TEST_STAMP := $(VENV)/.installed-test
CI_STAMP := $(VENV)/.installed-ci
LATEST_VENV := .venv-latest
LOCK_VENV := .venv-lock
# torch stays outside the hashed locks: a resolver would record PyPI's CUDA build, and these
# machines provide this CPU build locally (pip finds it; uv and other resolvers do not).
TORCH := torch==2.13.0
# The locks resolve torch's own dependencies from that CPU wheel, found here.
TORCH_WHEELS ?= /opt/wheels
LOCK_OPTIONS := --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
	--find-links $(TORCH_WHEELS) --no-emit-package torch --no-emit-find-links --quiet

.PHONY: demo test test-ci test-latest lock bench-quantize bench-convert clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Each lock is complete, so pip installs it as it stands (--no-deps) and `pip check` proves it.
# $(call install,LOCK,EXTRA): the lock, then EXTRA (torch, or nothing), then colibri itself.
define install
	$(BIN)/pip install --quiet --require-hashes --no-deps -r $(1)
	$(if $(2),$(BIN)/pip install --quiet --no-deps $(2))
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip check
endef

$(BASE_STAMP): locks/base.txt pyproject.toml | $(BIN)/python
	$(call install,locks/base.txt,)
	touch $@

$(TEST_STAMP): locks/test.txt pyproject.toml | $(BIN)/python
	$(call install,locks/test.txt,$(TORCH))
	touch $(BASE_STAMP) $@

# CI's set: the test set plus llama.cpp (built from source: a few minutes) and Ray Data.
$(CI_STAMP): locks/ci.txt pyproject.toml | $(BIN)/python
	$(call install,locks/ci.txt,$(TORCH))
	touch $(BASE_STAMP) $(TEST_STAMP) $@

demo: $(BASE_STAMP)
	$(BIN)/colibri demo

# Two processes (pytest-xdist), a test file each at a time: numba's compiles and the Python
# between kernels take one core, so a second process nearly halves the run on 2 cores.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: $(TEST_STAMP)
	$(PYTEST)

# What .ci/run runs: the whole suite, and a skip in the llama.cpp, Ray or Chromium tests fails it.
test-ci: $(CI_STAMP)
	COLIBRI_REQUIRE_OPTIONAL=1 $(PYTEST) --durations=25

# The newest release of everything but torch, in a venv of its own: drift fails here, not in CI.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install --quiet $(TORCH)
	$(LATEST_VENV)/bin/pip install --quiet --upgrade -e '.[test,oracle,serve]'
	$(LATEST_VENV)/bin/pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -q

# Rewrites locks/*.txt from pyproject.toml with what the registry serves today (uv, pinned).
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet uv==0.13.9; }
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml $(LOCK_OPTIONS) -o locks/base.txt
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml $(LOCK_OPTIONS) --extra test --extra oracle --extra serve -o locks/test.txt
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml $(LOCK_OPTIONS) --extra test --extra oracle --extra serve \
		--extra llama --extra ray -o locks/ci.txt

bench-quantize: $(BASE_STAMP)
	$(BIN)/python bench/quantize.py

bench-convert: $(BASE_STAMP)
	$(BIN)/python bench/convert.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(LOCK_VENV) demo-out bench/out .pytest_cache
