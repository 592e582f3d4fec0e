"""Layout validation: what a layout alone can say, and what it needs from model/training/cluster."""
import itertools

import pytest

from plan3d.errors import LayoutError
from plan3d.layout import AXES, Layout, check_layout, layout_problems, parse_order
from plan3d.specs.catalog import load_model
from plan3d.specs.training import TrainingSpec
from pydantic import ValidationError


@pytest.fixture(scope="module")
def gpt3():
    return load_model("gpt3-175b")


def problems(layout, model, batch=1536, world=512):
    return layout_problems(layout, model, TrainingSpec(global_batch=batch), world)


def test_seed_layout_is_valid(gpt3):
    assert problems(Layout(tp=8, pp=8, dp=8), gpt3) == []


@pytest.mark.parametrize("order", ["", "tp-cp-ep-dp-pp-tp", "tp-cp-ep-dp-xx", "tp-tp-ep-dp-pp", "pp-dp-"])
def test_bad_order_names_a_valid_example(order):
    with pytest.raises(LayoutError, match="tp-cp-ep-dp-pp"):
        parse_order(order)


@pytest.mark.parametrize("short, full", [
    ("pp-dp", "tp-cp-ep-pp-dp"),  # the recommend table's spelling
    ("dp-pp", "tp-cp-ep-dp-pp"),
    ("dp-tp", "dp-cp-ep-tp-pp"),  # the named axes swap slots; cp, ep, pp stay put
    ("pp", "tp-cp-ep-dp-pp"),
    ("tp-pp-dp", "tp-cp-ep-pp-dp"),
    ("tp-cp-ep-pp-dp", "tp-cp-ep-pp-dp"),
])
def test_short_order_fills_the_default_slots(short, full):
    assert "-".join(parse_order(short)) == full
    assert Layout(tp=2, pp=2, dp=2, order=short).order == full


@pytest.mark.parametrize("named", [p for n in range(1, 6) for p in itertools.permutations(AXES, n)])
def test_every_short_order_keeps_its_sequence_and_the_default_slots(named):
    axes = parse_order("-".join(named))
    assert sorted(axes) == sorted(AXES)
    assert [a for a in axes if a in named] == list(named)
    assert all(axes[i] == a for i, a in enumerate(AXES) if a not in named)


def test_layout_rejects_self_contradictions():
    with pytest.raises(ValidationError, match="vpp > 1 needs pp > 1"):
        Layout(vpp=2)
    with pytest.raises(ValidationError, match="sequence_parallel needs tp > 1"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValidationError, match="pp_layers needs"):
        Layout(pp=2, pp_layers=(48,))


def test_tp_not_dividing_heads_lists_valid_tp(gpt3):
    (msg,) = problems(Layout(tp=5, pp=8, dp=8), gpt3, world=512)[:1]
    assert "tp=5" in msg and "valid tp: 1, 2, 3, 4, 6, 8" in msg


def test_world_too_large(gpt3):
    msgs = problems(Layout(tp=8, pp=8, dp=16), gpt3, world=512)
    assert any("exceeds the cluster's 512 GPUs" in m for m in msgs)


def test_pipeline_must_divide_layers_unless_explicit_split(gpt3):
    assert any("does not divide 96 layers" in m for m in problems(Layout(tp=8, pp=5, dp=8), gpt3, world=320))
    uneven = Layout(tp=8, pp=5, dp=8, pp_layers=(20, 19, 19, 19, 19))
    assert problems(uneven, gpt3, world=320, batch=1536 - 1536 % 8) == []
    assert uneven.stage_layers(96) == (20, 19, 19, 19, 19)


def test_1f1b_needs_enough_micro_batches(gpt3):
    msgs = problems(Layout(tp=8, pp=8, dp=8, micro_batch=32), gpt3, batch=1536)
    assert any("1F1B needs at least pp=8 micro-batches, got 6" in m for m in msgs)


def test_interleaving_needs_micro_batches_multiple_of_pp(gpt3):
    # 1536 / (dp 8 * mb 16) = 12 micro-batches, not a multiple of pp=8
    msgs = problems(Layout(tp=8, pp=8, dp=8, micro_batch=16, vpp=2), gpt3)
    assert any("multiple of pp=8" in m for m in msgs)


def test_batch_divisibility(gpt3):
    assert any("not divisible by dp=7" in m for m in problems(Layout(tp=8, pp=8, dp=7), gpt3, world=448))
    assert any("micro-batch 5 does not divide" in m for m in problems(Layout(tp=8, pp=8, dp=8, micro_batch=5), gpt3))


def test_check_layout_raises_all_problems(gpt3):
    with pytest.raises(LayoutError) as err:
        check_layout(Layout(tp=5, pp=7, dp=8), gpt3, TrainingSpec(global_batch=1536), 512)
    assert "tp=5" in str(err.value) and "pp*vpp = 7" in str(err.value)


def test_stage_layers_even_split():
    assert Layout(pp=4, vpp=2).stage_layers(16) == (2,) * 8


def test_short_names_the_order_only_when_it_is_not_the_default():
    assert "order" not in Layout(tp=2, dp=2).short()
    assert Layout(tp=2, dp=2, order="tp-cp-ep-pp-dp").short().endswith("order pp-dp")
