# Two entry points (README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; numpy is required next to it (torch-notes.md).
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[runtime,dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	# 1. The seed example: the best layouts of GPT-3 175B on 512 A100-80GB.
	$(BIN)/plan3d recommend --cluster dgx-a100-80g --model gpt3-175b --top 8
	# 2. A small local launch: plan tiny-gpt on 8 CPU processes in 3D (tp2 x pp2 x dp2),
	#    then train it with the bundled runtime on the bundled text (byte tokens of the Python
	#    docs, --data python-docs) and compare measured with predicted.
	mkdir -p runs/demo
	$(BIN)/plan3d recommend --cluster local-cpu --model tiny-gpt --tp 2 --pp 2 --dp 2 --precision fp32 --top 3 --out runs/demo/plan.json
	$(BIN)/plan3d launch runs/demo/plan.json --data python-docs --steps 20

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
