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


def test_each_decision_is_a_different_shape_and_its_best_row(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    shapes = [shape(result, d.head) for d in decisions]
    assert len(set(shapes)) == len(shapes)
    first_of_shape = {}
    for row in map(int, feasible):
        first_of_shape.setdefault(shape(result, row), row)
    assert all(first_of_shape[shape(result, d.head)] == d.head for d in decisions)


def test_rows_passed_over_are_slower_copies_of_a_shown_decision(llama70b):
    result, feasible, values = llama70b
    decisions = grouping.group_decisions(result.layouts, values, feasible, 8)
    kept = {d.head for d in decisions} | {a for d in decisions for a in d.alternatives}
    head_of = {shape(result, d.head): d.head for d in decisions}
    last = list(map(int, feasible)).index(decisions[-1].head)
    passed_over = [row for row in map(int, feasible[:last]) if row not in kept]
    assert passed_over, "the case should pass over some rows (slower copies of a shown decision)"
    for row in passed_over:
        head = head_of[shape(result, row)]
        assert not grouping.ties(values[head], values[row]) and values[row] < values[head]


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


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-cp-ep-tp-pp", "pp-dp-tp-cp-ep"])
def test_short_order_reads_back_as_the_full_order(order):
    from plan3d.layout import full_order, short_order

    short = short_order(order)
    assert full_order(short) == order
    assert len(short) <= len(order)


# ---- through `plan3d recommend` --------------------------------------------------------------
GPT3 = ["recommend", "--cluster", "dgx-a100-80g", "--model", "gpt3-175b", "--top", "5"]


def recommend_json(capsys, *extra):
    import json

    from cli_helpers import run_cli

    code, out, err = run_cli(capsys, *GPT3, *extra, "--json")
    assert code == 0, err
    return json.loads(out)


def test_recommend_rows_are_distinct_decisions_with_alternatives_and_a_next(capsys):
    data = recommend_json(capsys)
    shapes = [tuple(r["layout"].get(k, 0) for k in grouping.DECISION_KNOBS) for r in data["top"]]
    assert len(set(shapes)) == len(shapes) == 5
    alternatives = [a for r in data["top"] for a in r["alternatives"]]
    assert alternatives and all(a["differs"] != "same knobs" for a in alternatives)
    for row in data["top"]:
        for alt in row["alternatives"]:
            assert alt["tokens_per_s"] >= row["tokens_per_s"] * (1 - grouping.TIE_FRACTION)
    assert data["next_alternative"]["tokens_per_s"] <= data["top"][-1]["tokens_per_s"]


def test_pick_and_plot_follow_the_table_rows(capsys, tmp_path):
    from plan3d.plan import load_plan

    data = recommend_json(capsys, "--pick", "3", "--out", str(tmp_path / "plan.json"))
    plan = load_plan(str(tmp_path / "plan.json"))
    assert plan.estimate.tokens_per_s == pytest.approx(data["top"][2]["tokens_per_s"], rel=1e-9)


def test_table_names_alternatives_under_it_and_the_next_choice(capsys):
    from cli_helpers import run_cli

    code, out, _ = run_cli(capsys, *GPT3)
    assert code == 0
    assert "#1 also:" in out and "next: #6" in out
