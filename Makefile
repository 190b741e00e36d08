# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel that lies on this machine's disk; override for another torch (>= 2.7).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv test lint typecheck pytest demo chaos-demo membership-demo clean

$(STAMP): pyproject.toml setup.py resilient/links/_stepio.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned, so that `torch>=2.7` in pyproject never pulls a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q --durations=15

test: lint typecheck pytest

# The chaos demo needs root (network namespaces); elsewhere the membership demo runs.
demo: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) chaos-demo; else \
		echo "make demo: not root, so no netns testbed; running the membership demo"; \
		$(MAKE) membership-demo; fi

chaos-demo: $(STAMP)
	$(BIN)/resilient chaos examples/scenarios/demo.toml --out chaos-demo

membership-demo: $(STAMP)
	$(BIN)/resilient run --nproc 4 --rails 2 --max-restarts 1 --lease-ttl 3 \
		examples/membership_demo.py --steps 16

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache chaos-demo

# The prepared device check of the CUDA path, on a GPU machine (at most 8 minutes on
# one GPU; a JSON line of figures last). Its Python: see scripts/gpu_check.sh.
.PHONY: gpu-check
gpu-check:
	bash scripts/gpu_check.sh
