# One-command set-up on a fresh machine: `make demo`, `make test`, `make install`.
# On a machine without a GPU the venv gets the pinned CPU torch (torch==2.13.0) — never an
# unpinned torch, which would pull a multi-GB CUDA build. On a GPU machine whose python3 already
# has torch (the device image: torch 2.11 + triton 3.6), the venv reuses it via system site-packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.k3rt-installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && $(PY) -c "import torch" >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
# SGLang's frontend for tests/compat, without its dependencies (a CUDA serving stack); the few it needs to
# import are in pyproject's test extra
SGLANG := sglang==0.5.23

.PHONY: install test demo clean

$(STAMP): pyproject.toml setup.py
ifeq ($(HAS_GPU),1)
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/pip install -q -e ".[backend,test]"
	$(BIN)/pip install -q --no-deps $(SGLANG)
else
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q torch==2.13.0 triton==3.6.0 "numpy<2.4"
	$(BIN)/pip install -q -e ".[backend,test]" torch==2.13.0
	$(BIN)/pip install -q --no-deps $(SGLANG)
endif
	touch $(STAMP)

install: $(STAMP)

# The suite: first everything but the `serial` tests on TEST_WORKERS processes (pytest-xdist; a file's tests stay
# on one worker, so module-scoped servers start once), then the `serial` tests alone: they bound wall-clock
# latencies that another worker's load would stretch. pytest's exit status 5 (nothing selected, e.g. a -k that
# matches only one part) counts as success.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: install
	@status=0; \
	set -x; $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not serial" $(PYTEST_ARGS); \
	rc=$$?; { set +x; } 2>/dev/null; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=$$rc; \
	set -x; $(BIN)/python -m pytest tests -m "serial and not gpu" $(PYTEST_ARGS); \
	rc=$$?; { set +x; } 2>/dev/null; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=$$rc; \
	exit $$status

# The main job on the embedded default model (k3-tiny, shipped inside the package): an example
# @k3rt.function program that completes a Python function, summarizes it as schema-constrained
# JSON and holds a short multi-turn exchange, on CPU.
demo: install
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) .cache build *.egg-info
