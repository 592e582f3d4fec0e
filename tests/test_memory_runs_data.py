"""benchmarks/data/memory_runs.yaml and benchmarks/memory.py: every table cites a source with a
location, every row becomes a case the cost model estimates, and the benchmark's verdicts on the
published layouts hold (no false refusal, every measured peak estimated)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "memory_runs.yaml"
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def data() -> dict:
    return yaml.safe_load(DATA.read_text())


@pytest.fixture(scope="module")
def memory():
    import memory as module  # benchmarks/memory.py
    return module


def test_every_table_cites_a_source_with_a_location(data):
    for table in data["tables"]:
        assert table["source"]["ref"] in data["sources"], table["id"]
        assert table["source"]["location"].strip(), table["id"]
        for row in table["rows"]:
            value = row.get("mem_gb", table["defaults"].get("mem_gb"))
            assert value == "OOM" or (isinstance(value, (int, float)) and 0 < value <= 200), (table["id"], row)


def test_every_row_is_a_case_with_the_layout_it_states(data, memory):
    cases = memory.memory_runs_cases(DATA)
    assert len(cases) == sum(len(t["rows"]) for t in data["tables"])
    for case in cases:
        assert case.layout.world_size == case.gpus
        assert case.model.dropout == 0.1  # the tr11 README: Megatron-LM's dropout defaults inherited


# The open error of the MoE activation model (issue 31): DeepSeek-V3 as published (RMSNorm + MLA
# up-projection recompute, DualPipe's p + 1 micro-batches in flight) at 78.8 of 76.0 GiB, within
# the 80 GiB device (the planning headroom alone refuses it); the report's FP8 SwiGLU inputs and
# bf16 AdamW moments, which the megatron-core profile does not keep, are the rest. The Qwen3-235B
# GB200 128K and "+1f1b overlap" rows fit since the combine keeps no expert outputs under
# Megatron-Core (RunsAs.moe_combine_output_bytes). A refusal outside this set fails.
KNOWN_OPEN_REFUSALS = {"deepseek-v3-pretraining-2048xh800"}


def test_the_benchmark_estimates_every_peak_and_refuses_no_published_layout(memory):
    if not memory.DATA.exists():  # the project's shared data sits beside the checkout, not in it
        pytest.skip(f"{memory.DATA} is not beside this checkout (clone it next to ../shared)")
    peaks = memory.peaks_report(memory.runs_yaml_cases() + memory.memory_runs_cases())
    assert peaks["summary"]["not_estimated"] == 0
    assert peaks["summary"]["peaks"] >= 81
    runs, _ = memory.published_runs()
    layouts = memory.layouts_report(runs)
    refused = {row["id"] for row in layouts["rows"] if row["verdict"] == "false_refusal"}
    assert refused <= KNOWN_OPEN_REFUSALS, refused - KNOWN_OPEN_REFUSALS
