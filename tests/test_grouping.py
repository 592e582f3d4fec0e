"""Top-K as distinct decisions (plan3d.grouping): near-copies fold into one row."""
import numpy as np
import pytest

from plan3d import grouping, ranking
from plan3d.search import search
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


@pytest.fixture(scope="module")
def llama70b():
    result = search(load_cluster("dgx-h100", 16), load_model("llama3-70b"), TrainingSpec(global_batch=256))
    order = ranking.rank(result)
    feasible = order[result.feasible[order]]
    values = grouping.objective_values(result.metrics, "throughput")
    return result, feasible, values


def shape(result, row):
    return tuple(int(result.layouts[k][row]) for k in grouping.DECISION_KNOBS)


def test_heads_are_distinct_decisions_in_rank_order(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    heads = [d.head for d in decisions]
    assert len(decisions) == 9  # eight rows and the next real alternative
    assert heads[0] == int(feasible[0])
    assert (np.diff(values[heads]) <= 0).all()
    for d in decisions:
        assert all(shape(result, a) == shape(result, d.head) for a in d.alternatives)
        assert all(grouping.ties(values[d.head], values[a]) for a in d.alternatives)


def test_same_shape_heads_do_not_tie(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    for i, a in enumerate(decisions):
        for b in decisions[i + 1:]:
            if shape(result, a.head) == shape(result, b.head):
                assert not grouping.ties(values[a.head], values[b.head])


def test_every_ranked_row_before_the_last_head_is_a_head_or_an_alternative(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    kept = {d.head for d in decisions} | {a for d in decisions for a in d.alternatives}
    last = list(map(int, feasible)).index(decisions[-2].head)
    assert set(map(int, feasible[: last + 1])) <= kept


def test_near_copies_fold_and_the_ungrouped_top_has_them(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    assert any(d.alternatives for d in decisions[:8])
    raw_shapes = [shape(result, int(r)) for r in feasible[:8]]
    assert len(set(raw_shapes)) < 8  # without grouping, the top 8 repeats a decision


def test_difference_names_what_changes(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    d = next(d for d in decisions if d.alternatives)
    words = grouping.difference(result.layout(d.head), result.layout(d.alternatives[0]))
    assert words and words != "same knobs"
    assert grouping.difference(result.layout(d.head), result.layout(d.head)) == "same knobs"
