# Two entry points: `make serve` (the server on the embedded tiny model) and `make test` (CPU suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# pytest processes of `make test`: the suite takes ~15 min in one process on 2 cores, ~10 in two
# (most tests wait on subprocesses: a server, an engine core, workers)
TEST_WORKERS ?= 2

.PHONY: serve test test-gpu venv venv-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch: the CPU build on machines without an NVIDIA driver (torch 2.13.0 is the CI build),
# whatever pip picks (a CUDA build) on GPU machines.
$(VENV)/.torch: | $(PY)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet "torch>=2.11"; \
	else $(PY) -m pip install --quiet torch==2.13.0; fi
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

serve: venv
	$(VENV)/bin/mini-deepinfer serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: venv-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# only the tests marked `gpu` (on a CUDA machine; the CPU suite's other tests are not run again there)
test-gpu: venv-test
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV)
