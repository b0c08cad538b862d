# The verbs a user types. PYTHON is the interpreter to install into and run with.
PYTHON ?= python3
# A CPU wheel by default; set TORCH="torch" (or a CUDA index) on a GPU machine.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test gate lint tiny

setup:
	$(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install -e ".[dev]"
	# z-lab's reference loop, an independent oracle for the gates (its pins are not ours)
	$(PYTHON) -m pip install --no-deps dflash==0.1.0

test:
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

gate:
	$(PYTHON) -m pytest -q gates $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check reference_engine harness gates reports scripts tests

tiny:
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch qwen3 --out tiny/qwen3
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch qwen3_5 --out tiny/qwen3_5
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch dflash --target tiny/qwen3_5 \
		--out tiny/qwen3_5-dflash --block-size 8
