# Two entry points (README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINES_STAMP := $(VENV)/.engines
MEGATRON_DIR := $(VENV)/megatron-core
MEGATRON_CORE := megatron-core==0.19.2
CORE_VENV := .venv-core
CORE_STAMP := $(CORE_VENV)/.installed

.PHONY: demo test test-core test-runtime runtime-venv venv engines clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; numpy is required next to it (torch-notes.md).
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[runtime,dev]'
	touch $(STAMP)

venv: $(STAMP)

# The engines tier (tests/engines): DeepSpeed (CPU, no ops built), torchtitan, shellcheck and
# Megatron-Core. megatron-core 0.19 declares Python >= 3.12; on an older Python its wheel is
# unpacked into $(MEGATRON_DIR), which the tests put on sys.path.
$(ENGINES_STAMP): $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[runtime,dev,engines]'
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then :; else \
	  $(BIN)/pip install -q --upgrade --target $(MEGATRON_DIR) --python-version 3.12 \
	    --only-binary=:all: --no-deps '$(MEGATRON_CORE)'; fi
	touch $(ENGINES_STAMP)

engines: $(ENGINES_STAMP)

# The planner as `pip install plan3d` installs it: no torch (plus the dev extra's test tools).
$(CORE_STAMP): pyproject.toml
	$(PY) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/pip install -q --upgrade pip
	$(CORE_VENV)/bin/pip install -q -e '.[dev]'
	touch $(CORE_STAMP)

demo: $(STAMP)
	# 1. The seed example: the best layouts of GPT-3 175B on 512 A100-80GB.
	$(BIN)/plan3d recommend --cluster dgx-a100-80g --model gpt3-175b --top 8
	# 2. A small local launch: plan tiny-gpt on 8 CPU processes in 3D (tp2 x pp2 x dp2),
	#    then train it with the bundled runtime on the bundled text (byte tokens of the Python
	#    docs, --data python-docs) and compare measured with predicted.
	mkdir -p runs/demo
	$(BIN)/plan3d recommend --cluster local-cpu --model tiny-gpt --tp 2 --pp 2 --dp 2 --precision fp32 --top 3 --out runs/demo/plan.json
	$(BIN)/plan3d launch runs/demo/plan.json --data python-docs --steps 20

# Every test, once, in three tiers (tests/conftest.py): the torch-free tier in a venv without
# torch, then the runtime (torch, multi-process gloo) and engines tiers; a missing engine fails.
# The torch-free tier runs while pip installs torch and the engines (network and disk, mostly).
test: $(CORE_STAMP)
	$(MAKE) -j2 test-core runtime-venv
	$(MAKE) test-runtime

runtime-venv: $(STAMP) $(ENGINES_STAMP)

test-core: $(CORE_STAMP)
	PLAN3D_TORCH_FREE=1 $(CORE_VENV)/bin/python -m pytest -q -m "not runtime and not engines"

test-runtime: $(STAMP) $(ENGINES_STAMP)
	PLAN3D_REQUIRE_ENGINES=1 $(BIN)/python -m pytest -q -m "runtime or engines"

clean:
	rm -rf $(VENV) $(CORE_VENV) runs
