"""The vTrain benchmark (benchmarks/accuracy.py) predicts each row as the layout it states: a
Megatron-DeepSpeed run with full recompute, exactly what `estimate()` predicts for that Layout.
(Its recompute code was once a bare 2, which came to mean moe-act when modes were added.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def accuracy(monkeypatch_module):
    monkeypatch_module.syspath_prepend(str(BENCHMARK.parent))  # its sibling modules (fitting.py)
    spec = importlib.util.spec_from_file_location("accuracy_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_row_is_predicted_as_its_layout_with_full_recompute(accuracy):
    cluster = load_cluster("vtrain-a100")
    row = {"gpus": 64, "global_batch": 64, "mb": 1, "hidden": 3072, "heads": 24, "layers": 30, "seq": 2048,
           "tp": 4, "dp": 8, "pp": 2, "measured_s": 1.0, "index": 0}
    predicted = accuracy.predict(cluster, [row])[0]
    model, training = accuracy.row_specs(row)
    sized = cluster.model_copy(update={"nodes": 64 // cluster.gpus_per_node})
    full = estimate(sized, model, training, Layout(tp=4, pp=2, dp=8, micro_batch=1, recompute="full")).step_time_s
    none = estimate(sized, model, training, Layout(tp=4, pp=2, dp=8, micro_batch=1, recompute="none")).step_time_s
    assert predicted == pytest.approx(full, rel=1e-9) and full > none
