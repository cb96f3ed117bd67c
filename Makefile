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

.PHONY: venv test test-avx2 lint typecheck pytest demo bench gpu-check clean

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

# The numerics tests again on an emulated AVX2-only CPU (no AVX-512, no bf16 units: most laptops and
# many servers), where bf16 and fp16 are emulated and ~30x slower than fp32.  The caps change
# ATen's and oneDNN's kernels, and ampkit's capability probe honours them.  Skipped where the CPU
# is already below AVX-512: the plain run was that machine.  .ci/run runs it beside `make test`.
AVX2_CAPS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: $(STAMP)
	@if [ "$$(env -u ATEN_CPU_CAPABILITY -u ONEDNN_MAX_CPU_ISA $(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" != "AVX512" ]; then \
		echo "test-avx2: this CPU has no AVX-512 kernels to cap; the plain test run already ran on an AVX2-class CPU"; \
	else \
		$(AVX2_CAPS) $(PY) -m pytest -m numerics; \
	fi

# The budget covers the training (probe + runs, the fp32 noise run included); the environment
# measurement and the report add seconds.  The probe picks the largest tinygpt size that fits,
# so on a 2-core AVX2-only CPU (bf16 emulated) the demo takes about 2 minutes, install included,
# with a conclusive verdict (docs/verify.md).
DEMO_BUDGET ?= 4m
demo: $(BASE)
	$(VENV)/bin/ampkit verify --out runs/demo --time-budget $(DEMO_BUDGET)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The GPU check runs on the interpreter that already holds the CUDA build of torch (PYTHON=...;
# default: this venv when it exists, else python3) and never builds a venv or installs torch.  It
# installs ampkit itself, without dependencies or downloads, unless that interpreter already imports
# this checkout; where the install is refused it runs ampkit from src/ (docs/gpu-check.md).
GPU_PYTHON := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
GPU_CHECK_ARGS ?=
gpu-check:
	@if ! $(GPU_PYTHON) -c "import ampkit, pathlib, sys; sys.exit(pathlib.Path(ampkit.__file__).resolve().parent != pathlib.Path('src/ampkit').resolve())" 2>/dev/null; then \
		$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation -e . \
		|| echo "gpu-check: could not install ampkit into $(GPU_PYTHON); running it from src/"; \
	fi
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
