"""The search over expert-parallel degrees: which ep it enumerates, how it rejects, how rows map back
to layouts (plan3d/search.py; the cost side is tests/test_moe_cost.py)."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.search import REASONS, Space, search, shape_grid, shape_reasons
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

SIX_EXPERTS = ModelSpec(name="six-experts", layers=4, hidden=64, heads=4, vocab=256, seq_len=32,
                        moe={"experts": 6, "top_k": 2, "expert_ffn_hidden": 64})


def test_a_dense_model_searches_ep1_only_and_its_grid_is_unchanged():
    grid = shape_grid(64, Space(), layers=80, seq_len=4096)
    assert (grid["ep"] == 1).all()
    assert len(grid["tp"]) == len(shape_grid(64, Space(max_ep=1), layers=80, seq_len=4096)["tp"])


def test_moe_grid_ep_divides_dp_cp_and_stays_within_the_experts():
    grid = shape_grid(64, Space(), layers=32, seq_len=4096, experts=8)
    ep, dp_cp = grid["ep"], grid["dp"] * grid["cp"]
    assert set(ep.tolist()) == {1, 2, 4, 8} and ((dp_cp % ep) == 0).all()
    bounded = shape_grid(64, Space(max_ep=2), layers=32, seq_len=4096, experts=8)
    assert set(bounded["ep"].tolist()) == {1, 2}
    fixed = shape_grid(64, Space(min_ep=4, max_ep=4), layers=32, seq_len=4096, experts=8)
    assert set(fixed["ep"].tolist()) == {4} and (fixed["dp"] * fixed["cp"] % 4 == 0).all()


@pytest.mark.parametrize("kwargs, match", [({"min_ep": 0}, "--min-ep=0"), ({"min_ep": 4, "max_ep": 2}, "--max-ep=2")])
def test_bad_ep_bounds_say_what_to_change(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Space(**kwargs)


def test_ep_that_does_not_divide_the_experts_is_rejected_with_its_reason():
    """6 experts on 8 GPUs: ep 4 and 8 divide dp but not the experts (code 18), ep 1 and 2 run."""
    training = TrainingSpec(global_batch=8)
    result = search(load_cluster("dgx-h100", 1), SIX_EXPERTS, training, engine=load_engine("megatron-core"))
    assert result.rejected.get(18, 0) > 0 and REASONS[18] == "ep does not divide the routed experts"
    assert set(result.layouts["ep"].tolist()) <= {1, 2}
    grid = {"tp": np.array([1, 1]), "pp": np.array([1, 1]), "dp": np.array([8, 8]), "ep": np.array([2, 4]),
            "micro_batch": np.array([1, 1]), "vpp": np.array([1, 1]), "sequence_parallel": np.array([False, False])}
    assert shape_reasons(grid, SIX_EXPERTS, training).tolist() == [0, 18]


def test_rows_map_back_to_layouts_with_their_ep():
    model = load_model("tiny-moe")
    result = search(load_cluster("dgx-h100", 1), model, TrainingSpec(global_batch=8),
                    engine=load_engine("megatron-core"))
    rows = np.flatnonzero(result.layouts["ep"] > 1)
    assert len(rows)
    layout = result.layout(int(rows[0]))
    assert layout.ep > 1 and result.find(layout) == int(rows[0])
    assert result.find(Layout(**{**layout.model_dump(), "ep": 1})) != int(rows[0])


def test_an_ep_no_degree_can_meet_is_named_with_the_possible_values(capsys):
    from cli_helpers import run_cli

    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", 2, "--ep", 3)
    assert code == 2 and "ep must divide the model's 8 experts and the 16 GPUs; possible ep: 1, 2, 4, 8" in err
    assert "Traceback" not in err
