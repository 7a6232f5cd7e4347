# pat_rollout: `make install && make demo` on a fresh CPU machine; `make test` runs the CI suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pat_installed
PYTEST_ARGS ?=

.PHONY: install install-sglang lint demo test test-fast test-sglang test-gpu bench check-size clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU wheel first (it lies on disk here); an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,verl]"
	touch $(STAMP)

# SGLang backend tests (also run by .ci/run): a separate venv (sglang pins torch 2.14.1; ~6 min, 11 GB).
# See pat_rollout/sglang/INSTALL.md.
SGL_VENV ?= .venv-sglang
SGL_STAMP := $(SGL_VENV)/.pat_installed

install-sglang: $(SGL_STAMP)

$(SGL_STAMP): setup.py
	test -x $(SGL_VENV)/bin/python || python3 -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGL_VENV)/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(SGL_VENV)/bin/python -m pip install -q "sglang==0.5.23" transformers pytest pytest-timeout
	$(SGL_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	$(SGL_VENV)/bin/python -m pytest tests/sglang_backend -q -rs -p no:cacheprovider --timeout=900

demo: $(STAMP)
	$(PY) -m pat_rollout.demo

test: $(STAMP)
	$(PY) -m pytest tests -q -rs --timeout=900 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -q -rs

bench: $(STAMP)
	$(PY) -m pat_rollout.bench.engine_vs_hf
	$(PY) -m pat_rollout.bench.sim_policies
	$(PY) -m pat_rollout.bench.reconfig_overhead

lint: $(STAMP)
	$(PY) -m ruff check --line-length 120 --select E,F,W,I --ignore E501 pat_rollout tests

check-size:
	@python3 -c "import pathlib,sys; big=[(p,n) for p in pathlib.Path('pat_rollout').rglob('*.py') if (n:=len(p.read_text().splitlines()))>800]; print('\n'.join(f'{p}: {n} lines > 800' for p,n in big)); sys.exit(1 if big else 0)"

clean:
	rm -rf $(VENV) build *.egg-info
