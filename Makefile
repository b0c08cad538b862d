# The verbs a user types. PYTHON is the interpreter to install into and run with.
PYTHON ?= python3
# make setup (scripts/setup.sh says more): TORCH empty is the CPU build of torch 2.13.0, from
# PyTorch's CPU index; on a GPU machine TORCH=torch TORCH_INDEX= (or your CUDA build's index).
# DEPS=range (the newest inside pyproject's ranges), newest (upgrade an existing environment
# to them) or tested (requirements/tested-cpu.txt, the exact set the CPU tier last passed with).
TORCH ?=
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
DEPS ?= range
# no: leave out the peer clients (requirements/peers.txt, about 1.3 GB in .peers/); their tests skip
PEERS ?= yes
PYTEST_ARGS ?=
# make test's pytest processes (pytest-xdist): the CPU tier keeps one core busy, two halve it
# on 2 cores; 0 runs it in this process alone, auto on every core
TEST_WORKERS ?= 2

# the trained demo pair shipped in the package (reference_engine/assets/demo)
DEMO ?= reference_engine/assets/demo
BENCH_OUT ?= results/bench-$(shell date +%Y%m%d-%H%M%S)
BENCH_BLOCK ?= 8
BENCH_ARGS ?= --concurrency 1,4,8,16 --output-len 128 --repeats 3 --dataset $(DEMO)/heldout_prompts.jsonl
# set to force a mean acceptance length with the oracle proposer (cost only, output unchecked)
BENCH_ACCEPTANCE ?=
# cuda when torch sees a GPU, else cpu (worked out only when a target uses it)
BENCH_DEVICE ?= $(shell $(PYTHON) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
# CPU threads per operator of each server: on the CPU 1, since the harness's client shares the
# cores and operators whose threads wait on each other for a busy core run several times
# slower (docs/harness.md, "make bench on the CPU and on the H200"); empty: torch's default
BENCH_THREADS ?= $(if $(filter cpu,$(BENCH_DEVICE)),1,)
# side B's verify-width costs: on the CPU timed from whole eager steps at start-up (plain
# steps among the choices, docs/engine.md "Verify width"); CUDA graphs time their own
BENCH_STEP_COSTS ?= $(if $(filter cpu,$(BENCH_DEVICE)),--measure-step-costs,)
# where each server's engine steps (--engine-loop): empty is the server's auto (a process of its
# own on a GPU, a thread on the CPU); process or thread to choose
BENCH_ENGINE_LOOP ?=

# make profile: where each step's time goes, plain vs DFlash, under Nsight Systems
# (scripts/profile.sh); NSYS=none uses the built-in phase timer instead. PROFILE_ARGS is the
# engine benchmark's workload.
PROFILE_OUT ?= results/profile-$(shell date +%Y%m%d-%H%M%S)
PROFILE_CONCURRENCY ?= 1,8
# CPU threads per operator of each benchmark process: as BENCH_THREADS (1 on the CPU)
PROFILE_THREADS ?= $(BENCH_THREADS)
PROFILE_ARGS ?= --model $(DEMO)/target --draft $(DEMO)/draft --prompts $(DEMO)/heldout_prompts.jsonl \
	--commit-strategy per_token --block-size 8 --output-len 128
NSYS ?=

.PHONY: setup test gate gate-gpu lint format tiny bench profile

setup:
	PYTHON="$(PYTHON)" TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)" DEPS="$(DEPS)" PEERS="$(PEERS)" bash scripts/setup.sh

test:
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

gate:
	$(PYTHON) -m pytest -q gates $(PYTEST_ARGS)

# the GPU tier: kernel tests compiled, bitwise invariance, and the exact-bfloat16 gates
# (DFlash == plain greedy bit for bit); needs CUDA. PYTEST_ARGS="--target-model DIR
# --draft-model DIR" points it at your own checkpoints.
gate-gpu:
	$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: make gate-gpu needs a CUDA device')"
	$(PYTHON) -m pytest -q -m "gpu or kernels" tests gates $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

tiny:
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch qwen3 --out tiny/qwen3
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch qwen3_5 --out tiny/qwen3_5
	$(PYTHON) -m reference_engine.checkpoint make-tiny --arch dflash --target tiny/qwen3_5 \
		--out tiny/qwen3_5-dflash --block-size 8

# A/B on our reference server: plain baseline vs DFlash, the shipped demo pair (a trained
# Qwen3.5 hybrid target and its DFlash draft) on its held-out prompts, whatever device is
# present: real acceptance. BENCH_ACCEPTANCE=X forces X with the oracle proposer instead.
BENCH_SERVE = $(PYTHON) -m reference_engine.serve --model $(DEMO)/target --commit-strategy per_token \
	--device $(BENCH_DEVICE) --max-num-seqs 16 $(if $(BENCH_THREADS),--threads $(BENCH_THREADS)) \
	$(if $(BENCH_ENGINE_LOOP),--engine-loop $(BENCH_ENGINE_LOOP))
# BENCH_DRAFT: side B's draft, `dflash` (the shipped DFlash draft), `dflash2` (the shipped
# DFlash2 draft: docs/demo-pair.md, "A DFlash2 demo draft") or a draft folder for the demo
# target.
BENCH_DRAFT ?= dflash
BENCH_DRAFT_DIR = $(if $(filter dflash,$(BENCH_DRAFT)),$(DEMO)/draft,$(if $(filter dflash2,$(BENCH_DRAFT)),$(DEMO)/draft-dflash2,$(BENCH_DRAFT)))
BENCH_NOTES = demo pair (reference_engine/assets/demo) on its held-out prompts, draft $(BENCH_DRAFT_DIR), DFlash block size $(BENCH_BLOCK)
bench:
	@test -f "$(BENCH_DRAFT_DIR)/config.json" || { echo "make bench: BENCH_DRAFT=$(BENCH_DRAFT): no config.json in $(BENCH_DRAFT_DIR) (expected dflash, dflash2 or a draft folder for the demo target)" >&2; exit 2; }
	$(PYTHON) -m harness ab \
		--a-cmd "$(BENCH_SERVE) --port {port}" \
		--b-cmd "$(BENCH_SERVE) --dflash-draft-model-path $(BENCH_DRAFT_DIR) --block-size $(BENCH_BLOCK) $(BENCH_STEP_COSTS) $(if $(BENCH_ACCEPTANCE),--oracle-acceptance $(BENCH_ACCEPTANCE)) --port {port}" \
		--a-label plain --b-label $(if $(filter dflash2,$(BENCH_DRAFT)),dflash2,dflash) $(BENCH_ARGS) --out $(BENCH_OUT) \
		--notes "$(BENCH_NOTES)$(if $(BENCH_ACCEPTANCE),; acceptance forced to $(BENCH_ACCEPTANCE) by the oracle proposer (output not checked in this mode),; real acceptance)"

profile:
	NSYS="$(NSYS)" PYTHON="$(PYTHON)" PROFILE_THREADS="$(PROFILE_THREADS)" bash scripts/profile.sh \
		--out "$(PROFILE_OUT)" --concurrency "$(PROFILE_CONCURRENCY)" $(PROFILE_ARGS)
