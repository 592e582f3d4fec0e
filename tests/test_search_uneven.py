"""Uneven splits are evaluated vectorised (`search.evaluate_uneven`, one cost-model call per pipeline
degree); each layout's metrics must equal the scalar `estimate()` of the same Layout."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.cli.common import make_training
from plan3d.search import Space, balanced_split, evaluate_scalar, rank_layers, search
from plan3d.specs.catalog import engine_for, load_cluster, load_model


@pytest.mark.parametrize("cluster, model, nodes, engine", [
    ("dgx-h100", "llama3-405b", 64, None),  # 126 layers: pp 4..64 only with --uneven
    ("dgx-h100", "llama3-405b", 16, "megatron-core"),
    ("dgx-a100-80g", "bloom-176b", 48, "megatron-deepspeed"),  # searched uneven by the engine itself
])
def test_vectorised_uneven_metrics_equal_the_scalar_estimate(cluster, model, nodes, engine):
    spec = load_cluster(cluster, nodes, None)
    model_spec = load_model(model)
    training = make_training(global_batch=model_spec.default_global_batch)
    engine_spec = engine_for(engine, spec) if engine else None
    result = search(spec, model_spec, training, Space(uneven=True), engine=engine_spec)
    uneven = np.flatnonzero(result.layouts["uneven"])
    assert len(uneven) > 0
    rows = uneven[:: max(1, len(uneven) // 120)]  # every pipeline degree and vpp, a sample of the rest
    reference = evaluate_scalar(spec, model_spec, training, {k: a[rows] for k, a in result.layouts.items()},
                                result.orders, engine_spec)
    for key, expected in reference.items():
        np.testing.assert_allclose(result.metrics[key][rows].astype(float), np.asarray(expected, dtype=float),
                                   rtol=1e-9, atol=0, err_msg=key)


def test_rank_layers_sums_each_ranks_chunks():
    table = rank_layers(126, 4, np.array([1, 2]))
    assert table.shape == (4, 2)
    assert list(table[:, 0]) == list(balanced_split(126, 4))
    split = balanced_split(126, 8)
    assert list(table[:, 1]) == [split[r] + split[r + 4] for r in range(4)]
    assert (table.sum(axis=0) == 126).all()
