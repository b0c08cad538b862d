# The verbs a user types. PYTHON is the interpreter to install into and run with.
PYTHON ?= python3
# A CPU wheel by default; set TORCH="torch" (or a CUDA index) on a GPU machine.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

BENCH_OUT ?= results/bench-$(shell date +%Y%m%d-%H%M%S)
BENCH_ACCEPTANCE ?= 4.0
BENCH_ARGS ?= --concurrency 1,4,8,16 --output-len 64 --repeats 3

# make profile: where each step's time goes, plain vs DFlash, under Nsight Systems
# (scripts/profile.sh); NSYS=none uses the built-in phase timer instead. PROFILE_ARGS is the
# engine benchmark's workload.
PROFILE_OUT ?= results/profile-$(shell date +%Y%m%d-%H%M%S)
PROFILE_CONCURRENCY ?= 1,8
PROFILE_ARGS ?= --random-shape qwen3.5-small --oracle-acceptance 6.5
NSYS ?=

.PHONY: setup test gate lint tiny bench profile

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

# A/B on our reference server: plain baseline vs DFlash, the tiny pair, whatever device
# is present. Random tiny weights are accepted about never, so the DFlash server forces a
# mean acceptance length of BENCH_ACCEPTANCE with the oracle proposer (stated in the report).
bench: tiny
	$(PYTHON) -m harness ab \
		--a-cmd "$(PYTHON) -m reference_engine.serve --model tiny/qwen3_5 --port {port}" \
		--b-cmd "$(PYTHON) -m reference_engine.serve --model tiny/qwen3_5 --dflash-draft-model-path tiny/qwen3_5-dflash --oracle-acceptance $(BENCH_ACCEPTANCE) --port {port}" \
		$(BENCH_ARGS) --out $(BENCH_OUT) \
		--notes "tiny random Qwen3.5 pair; DFlash acceptance forced to $(BENCH_ACCEPTANCE) by the oracle proposer (output not checked in this mode)"

profile:
	NSYS="$(NSYS)" PYTHON="$(PYTHON)" bash scripts/profile.sh --out "$(PROFILE_OUT)" \
		--concurrency "$(PROFILE_CONCURRENCY)" $(PROFILE_ARGS)
