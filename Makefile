# Everything installs from nothing: `make test` and `make demo` create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Pinned: resolves to the CPU wheel on CPU-only machines and to the normal build elsewhere.
TORCH  := torch==2.13.0
# Two install levels: the demo needs ampkit and its report extra only; the tests and benchmarks
# also need the dev extra (linters, and transformers, accelerate and lightning for the integrations).
BASE   := $(VENV)/.ampkit-base
STAMP  := $(VENV)/.ampkit-installed

.PHONY: venv test lint typecheck pytest demo bench clean

$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[report]"
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy src

pytest: $(STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

# The budget covers the training (probe + runs); the environment measurement and the report add
# seconds.  Under 5 minutes with bf16 units, under 10 on a 2-core AVX2-only CPU (docs/verify.md).
DEMO_BUDGET ?= 4m
demo: $(BASE)
	$(VENV)/bin/ampkit verify --out runs/demo --time-budget $(DEMO_BUDGET)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
