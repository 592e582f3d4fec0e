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


# ---- the rule table: one expression judges one layout and an array of them ----------------------
def random_shapes(rng, n: int, layers: int) -> list[Layout]:
    """Well-formed layouts with small degrees, some with an explicit (balanced) pp_layers split."""
    from plan3d.search import balanced_split

    out = []
    while len(out) < n:
        tp, pp, dp, mb, vpp = (int(v) for v in rng.integers(1, 9, size=5))
        vpp = vpp if pp > 1 else 1
        sp = bool(rng.integers(0, 2)) and tp > 1
        split = balanced_split(layers, pp * vpp) if pp * vpp <= layers and rng.random() < 0.3 else None
        out.append(Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, vpp=vpp, sequence_parallel=sp, pp_layers=split))
    return out


@pytest.mark.parametrize("model_name, batch, seq", [("gpt3-175b", 1536, None), ("tiny-gpt", 24, 30),
                                                    ("llama3-8b", 64, 4096)])
def test_every_rule_judges_an_array_as_it_judges_each_layout(model_name, batch, seq):
    """The search reads LAYOUT_RULES over arrays (RuleFacts of arrays), layout_problems one layout at
    a time (RuleFacts.of): each rule must give the same verdict both ways, row by row."""
    import numpy as np

    from plan3d.layout import LAYOUT_RULES, RuleFacts

    model, training = load_model(model_name), TrainingSpec(global_batch=batch, seq_len=seq)
    shapes = random_shapes(np.random.default_rng(13), 400, model.layers)
    column = {k: np.array([getattr(lay, k) for lay in shapes]) for k in ("tp", "pp", "dp", "micro_batch", "vpp",
                                                                         "sequence_parallel")}
    uneven = np.array([lay.pp_layers is not None for lay in shapes])
    arrays = RuleFacts(model, training, uneven=uneven, **column)
    for rule in LAYOUT_RULES:
        together = np.broadcast_to(rule.fails(arrays), (len(shapes),))
        one_by_one = [bool(rule.fails(RuleFacts.of(lay, model, training, lay.world_size))) for lay in shapes]
        assert together.tolist() == one_by_one, rule.reason
    assert any(rule.fails(arrays).any() for rule in LAYOUT_RULES if rule.code), "the sample should break rules"


def test_the_search_reasons_are_the_rule_table():
    from plan3d.layout import LAYOUT_RULES
    from plan3d.search import REASONS, shape_reasons

    coded = [rule for rule in LAYOUT_RULES if rule.code is not None]
    codes = [rule.code for rule in coded]
    assert codes == sorted(set(codes)) and codes[:9] == list(range(1, 10))  # table order is the search's order
    assert set(codes[9:]) == {17, 18, 23, 24}  # the expert rules and the schedule's micro-batches, after the fit (10-12) and search (13-16, 19-22) codes
    assert all(REASONS[rule.code] == rule.reason for rule in coded)
    # a shape breaking rules 2 (ffn) and 5 (batch) carries the first, as layout_problems lists it first
    import numpy as np

    from plan3d.specs.model import ModelSpec

    model = ModelSpec(name="odd-ffn", layers=4, hidden=64, heads=4, ffn_hidden=129, vocab=100, seq_len=32)
    training = TrainingSpec(global_batch=9)
    grid = {"tp": [2], "pp": [1], "dp": [2], "micro_batch": [1], "vpp": [1], "sequence_parallel": [False]}
    assert shape_reasons({k: np.array(v) for k, v in grid.items()}, model, training).tolist() == [2]
    sentences = layout_problems(Layout(tp=2, dp=2), model, training, 4)
    assert [s.split()[0] for s in sentences] == ["tp=2", "global"]


# ---- same placement: one rule for the search and the emitters --------------------------------------
def test_same_groups_as_is_exactly_an_equal_rank_map():
    """Layout.same_groups_as (the rule the search drops orders by and the emitters check) against the
    truth: two orders are one placement exactly when every group of the rank map is the same."""
    from plan3d.rankmap import RankMap

    orders = ["-".join(p) for p in itertools.permutations(AXES)][::7]
    for tp, cp, dp, pp in itertools.product((1, 2), (1, 2), (1, 3), (1, 2)):
        shape = Layout(tp=tp, cp=cp, dp=dp, pp=pp)
        groups = {o: tuple(tuple(map(tuple, RankMap(shape.model_copy(update={"order": o}), 8).groups(kind)))
                           for kind in ("tp", "cp", "dp", "pp")) for o in orders}
        for a, b in itertools.combinations(orders, 2):
            assert shape.model_copy(update={"order": a}).same_groups_as(b) == (groups[a] == groups[b]), (shape, a, b)


def test_the_search_drops_an_order_exactly_when_same_groups_as_says_so():
    import numpy as np

    from plan3d.search import same_placement

    orders = tuple("-".join(p) for p in itertools.permutations(AXES))[::5]
    rows = [(tp, pp, dp, i) for tp, pp, dp in itertools.product((1, 2), (1, 4), (1, 3)) for i in range(len(orders))]
    layouts = {k: np.array(v) for k, v in zip(("tp", "pp", "dp", "order"), zip(*rows))}
    dropped = same_placement(layouts, orders)
    for (tp, pp, dp, i), drop in zip(rows, dropped):
        layout = Layout(tp=tp, pp=pp, dp=dp, order=orders[i])
        assert drop == any(layout.same_groups_as(earlier) for earlier in orders[:i]), layout.short()
    assert 0 < dropped.sum() < len(rows)


def test_job_problems_are_the_layout_rules_then_the_engines():
    """One call for the pair every job check makes: a layout breaking a rule (tp=5 of 96 heads) and
    something the engine cannot run (ZeRO-3 with pp on Megatron-DeepSpeed) gives both sentences,
    the rule's first; without an engine only the rule's."""
    from plan3d.layout import job_problems
    from plan3d.specs.catalog import load_engine

    model, training = load_model("gpt3-175b"), TrainingSpec(global_batch=1536)
    layout = Layout(tp=5, pp=2, dp=4, zero=3)
    both = job_problems(layout, model, training, 512, load_engine("megatron-deepspeed"))
    assert "tp=5" in both[0] and any("ZeRO-3" in p and "megatron-deepspeed" in p for p in both[1:])
    assert job_problems(layout, model, training, 512) == layout_problems(layout, model, training, 512)
