"""The search space: generation, bounds, and the vectorised rules against layout_problems."""
import itertools

import numpy as np
import pytest

from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems, problem_codes
from plan3d.search import (REASONS, SHAPE_KNOBS, Space, degree_triples, expand_layouts, layout_at, layout_row,
                           shape_grid, shape_reasons)
from plan3d.specs.catalog import load_model
from plan3d.specs.order import DEFAULT_ORDER
from plan3d.specs.schedule import schedule_names
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

def first_code(layout, model, training, world) -> int:
    """The search's code for `layout` from the scalar side of LAYOUT_RULES: its first broken rule's (0: valid)."""
    codes = problem_codes(layout, model, training, world)
    return codes[0] if codes else 0


ODD_MODEL = ModelSpec(name="odd", layers=12, hidden=192, heads=12, kv_heads=4, ffn_hidden=520,
                      activation="swiglu", vocab=1000, seq_len=90)

CASES = [
    ("gpt3-175b", 64, 1536, None),
    ("llama3-405b", 128, 2048, None),
    ("tiny-gpt", 8, 16, None),
    ("tiny-gpt", 48, 12, 30),
    (ODD_MODEL, 72, 36, None),
    (ODD_MODEL, 60, 20, 48),
]


@pytest.mark.parametrize("model_name, world, batch, seq", CASES, ids=lambda v: str(getattr(v, "name", v)))
def test_vectorised_rules_agree_with_layout_problems(model_name, world, batch, seq):
    model = load_model(model_name) if isinstance(model_name, str) else model_name
    training = TrainingSpec(global_batch=batch, seq_len=seq)
    grid = shape_grid(world, Space(max_micro_batch=6, max_vpp=4, schedules=schedule_names()))
    codes = shape_reasons(grid, model, training)
    assert 0 < (codes == 0).sum() < len(codes), "the case should have valid and invalid shapes"
    assert len(set(codes.tolist())) > 3, "the case should break several rules"

    def problems(layout):
        return layout_problems(layout, model, training, world)

    for i in range(len(codes)):
        layout = layout_at(dict(grid, zero=np.zeros(len(codes), int), recompute=np.zeros(len(codes), int),
                                order=np.zeros(len(codes), int)), (DEFAULT_ORDER,), i)
        assert codes[i] == first_code(layout, model, training, world), (layout.short(), problems(layout))


def test_every_factorization_is_generated_once():
    triples = degree_triples(96, Space())
    assert (triples.prod(axis=1) == 96).all()
    assert len({tuple(t) for t in triples.tolist()}) == len(triples)
    brute = [(t, p, d) for t, p, d in itertools.product(range(1, 97), repeat=3) if t * p * d == 96]
    assert len(triples) == len(brute)


def test_bounds_and_fixed_knobs_restrict_the_space():
    space = Space(min_tp=8, max_tp=8, max_pp=16, max_micro_batch=2, sequence_parallel=(False,))
    grid = shape_grid(512, space)
    assert set(grid["tp"].tolist()) == {8}
    assert grid["pp"].max() == 16 and grid["micro_batch"].max() == 2
    assert not grid["sequence_parallel"].any()


def test_only_well_formed_layouts_are_generated():
    grid = shape_grid(64, Space())
    assert not ((grid["vpp"] > 1) & (grid["pp"] == 1)).any()
    assert not (grid["sequence_parallel"] & (grid["tp"] == 1)).any()


def test_expansion_covers_zero_recompute_order_and_round_trips():
    space = Space(zero=(0, 3), recompute=("none", "full"))
    grid = shape_grid(8, space)
    layouts = expand_layouts(grid, space)
    assert len(layouts["tp"]) == len(grid["tp"]) * 2 * 2 * 2
    rows = {tuple(int(layouts[k][i]) for k in layouts) for i in range(len(layouts["tp"]))}
    assert len(rows) == len(layouts["tp"])
    for i in (0, 5, len(layouts["tp"]) - 1):
        layout = layout_at(layouts, space.orders, i)
        assert layout_row(layout, space.orders) == {k: layouts[k][i].item() for k in layouts}


@pytest.mark.parametrize("kwargs, match", [
    ({"recompute": ("some",)}, "recompute"),
    ({"zero": (4,)}, "ZeRO"),
    ({"min_tp": 4, "max_tp": 2}, "min <= max"),
    ({"orders": ("tp-foo",)}, "order"),  # ("tp-dp" is a valid short form since issue 18)
])
def test_bad_space_says_what_to_change(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Space(**kwargs)


def test_every_reason_has_a_sentence():
    assert set(range(1, 25)) == set(REASONS)  # 17, 18, 23: the expert layout rules; 24 the schedule's micro-batches; 19, 20 the engine's MoE rules; 21 a2a CP heads; 22 idle partial recompute
    assert np.int8(max(REASONS)) == max(REASONS)
