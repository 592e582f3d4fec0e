"""`plan3d recommend` and `plan3d explain` through the real entry point."""
import json

import pytest

from plan3d.plan import load_plan
from cli_helpers import run_cli  # noqa: E402

SMALL = ["--cluster", "dgx-a100-80g", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "64"]


run = run_cli


def run_json(capsys, *args):
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_json_has_schema_stats_and_ranked_feasible_rows(capsys):
    data = run_json(capsys, "recommend", *SMALL, "--top", "4")
    assert data["schema_version"] == 1
    stats = data["search"]
    assert stats["layouts_considered"] >= stats["layouts_evaluated"] >= stats["feasible"] > 0
    assert stats["seconds"] > 0 and sum(stats["rejected"].values()) > 0
    rows = data["top"]
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    assert all(r["fits"] and r["headroom_bytes"] >= 0 for r in rows)
    tokens = [r["tokens_per_s"] for r in rows]
    assert tokens == sorted(tokens, reverse=True)
    assert data["pareto_front"] and data["why"]


def test_table_shows_columns_reasons_and_why(capsys):
    code, out, _ = run(capsys, "recommend", *SMALL, "--top", "3")
    assert code == 0
    for text in ("tokens/s", "MFU", "bubble", "headroom", "why #1", "rejected", "layouts/s"):
        assert text in out


@pytest.mark.parametrize("pick", [1, 3])
def test_out_writes_the_plan_of_the_picked_layout(capsys, tmp_path, pick):
    path = tmp_path / "plan.json"
    data = run_json(capsys, "recommend", *SMALL, "--top", "3", "--out", str(path), "--pick", str(pick))
    plan = load_plan(str(path))
    wanted = data["top"][pick - 1]["layout"]
    assert plan.layout.model_dump(mode="json", include=set(wanted)) == wanted
    assert plan.estimate.tokens_per_s == pytest.approx(data["top"][pick - 1]["tokens_per_s"], rel=1e-9)


@pytest.mark.parametrize("flags, check", [
    (["--tp", "2"], lambda lay: lay["tp"] == 2),
    (["--max-pp", "2"], lambda lay: lay["pp"] <= 2),
    (["--no-recompute"], lambda lay: lay["recompute"] == "none"),
    (["--zero", "1", "--zero", "2"], lambda lay: lay["zero"] in (1, 2)),
    (["--no-sequence-parallel"], lambda lay: not lay["sequence_parallel"]),
    (["--order", "tp-cp-ep-pp-dp"], lambda lay: lay["order"] == "tp-cp-ep-pp-dp"),
])
def test_user_constraints_bound_every_row(capsys, flags, check):
    data = run_json(capsys, "recommend", *SMALL, "--top", "20", *flags)
    assert data["top"] and all(check(r["layout"]) for r in data["top"])


def test_nothing_fits_exits_1_with_misses_and_what_to_change(capsys):
    code, out, err = run(capsys, "recommend", "--cluster", "dgx-h100", "--model", "llama3-405b", "--nodes", "2",
                         "--global-batch", "64")
    assert code == 1
    assert "nearest misses" in out and "--nodes" in out
    assert err.startswith("error: no layout of llama3-405b fits")


def test_nothing_fits_json_lists_changes(capsys):
    code, out, _ = run(capsys, "recommend", "--cluster", "dgx-a100-80g", "--model", "gpt3-175b", "--nodes", "4",
                       "--json")
    assert code == 1
    data = json.loads(out)
    assert data["search"]["feasible"] == 0 and data["nearest_misses"]
    assert data["nodes_needed"] > 4
    changes = [c for m in data["nearest_misses"] for c in m["what_to_change"]]
    assert changes and all(c["peak_memory_bytes"] > 0 for c in changes)


def test_node_sweep_answers_how_many_nodes(capsys):
    data = run_json(capsys, "recommend", "--cluster", "dgx-a100-80g", "--model", "gpt3-175b", "--min-nodes", "8",
                    "--max-nodes", "64", "--top", "1")
    sweep = data["node_sweep"]
    assert [s["nodes"] for s in sweep] == [8, 16, 32, 64]
    first_fit = next(s for s in sweep if s["feasible"])
    assert data["nodes"] == first_fit["nodes"]


@pytest.mark.parametrize("args, match", [
    (["--objective", "speed"], "--objective"),
    (["--min-tp", "4", "--max-tp", "2"], "min <= max"),
    (["--min-mfu", "40"], "--min-mfu"),
    (["--pick", "0"], "--pick"),
])
def test_bad_flags_exit_2_with_the_fix(capsys, args, match):
    code, _, err = run(capsys, "recommend", *SMALL, *args)
    assert code == 2 and match in err


def test_explain_ranks_a_layout_against_the_best(capsys):
    data = run_json(capsys, "explain", *SMALL, "--tp", "2", "--pp", "2", "--micro-batch", "1")
    assert data["position"] >= 1 and data["layout"]["layout"]["tp"] == 2
    assert data["best"]["tokens_per_s"] >= data["layout"]["tokens_per_s"]
    code, out, _ = run(capsys, "explain", *SMALL, "--tp", "2", "--pp", "2")
    assert code == 0 and "against the best" in out


def test_explain_invalid_layout_exits_2(capsys):
    code, _, err = run(capsys, "explain", *SMALL, "--tp", "3", "--pp", "1", "--dp", "5")
    assert code == 2 and "tp=3" in err


def test_recommend_explain_flag(capsys):
    data = run_json(capsys, "recommend", *SMALL, "--top", "2", "--explain", "--pick", "2")
    assert data["explain"]["position"] == 2


def test_uneven_splits_are_searched_by_default_and_even_only_on_request(capsys, tmp_path):
    args = ["recommend", "--cluster", "dgx-a100-80g", "--model", "tiny-gpt", "--nodes", "1", "--global-batch", "24",
            "--max-micro-batch", "1", "--top", "50"]
    even = run_json(capsys, *args, "--even")
    uneven = run_json(capsys, *args)
    assert [r["layout"] for r in run_json(capsys, *args, "--uneven")["top"]] == [r["layout"] for r in uneven["top"]]
    assert uneven["search"]["layouts_considered"] == even["search"]["layouts_considered"]
    assert uneven["search"]["layouts_evaluated"] > even["search"]["layouts_evaluated"]
    splits = [r["layout"]["pp_layers"] for r in uneven["top"] if "pp_layers" in r["layout"]]
    assert splits and all(sum(s) == 8 and max(s) - min(s) == 1 for s in splits)
    assert not any("pp_layers" in r["layout"] for r in even["top"])


def test_even_only_names_the_option_that_lifts_the_refusals(capsys):
    code, out, _ = run(capsys, "recommend", "--cluster", "dgx-a100-80g", "--model", "tiny-gpt", "--nodes", "3",
                       "--pp", "3", "--global-batch", "24", "--top", "3", "--even")
    assert code != 0 and "pp*vpp does not divide the layer count (--uneven lifts it)" in out.replace("\n", " ")
    data = run_json(capsys, "recommend", "--cluster", "dgx-a100-80g", "--model", "tiny-gpt", "--nodes", "3",
                    "--pp", "3", "--global-batch", "24", "--top", "3")
    assert data["top"] and all(r["layout"]["pp"] == 3 and sum(r["layout"]["pp_layers"]) == 8 for r in data["top"])


def test_recommend_says_when_it_ranks_on_datasheet_values(capsys):
    data = run_json(capsys, "recommend", "-c", "mi300x", "-m", "llama3-8b", "--nodes", "1", "--global-batch", "64",
                    "--top", "2")
    assert any("mi300x" in w and "datasheet only" in w for w in data["warnings"])
    code, out, _ = run(capsys, "recommend", "-c", "mi300x", "-m", "llama3-8b", "--nodes", "1", "--global-batch", "64",
                       "--top", "2")
    assert code == 0 and "datasheet only" in out.replace("\n", " ")
    fitted = run_json(capsys, "recommend", *SMALL, "--top", "2")
    assert not any("datasheet only" in w for w in fitted["warnings"])


def test_a_default_cp_bound_of_1_is_named_with_the_flag_that_lifts_it(capsys):
    mcore = [*SMALL, "--engine", "megatron-core", "--top", "1"]
    _, out, _ = run(capsys, "recommend", *mcore, "--seq-len", "8192")
    assert "cp not searched" in out and "--max-cp 2" in " ".join(out.split())
    _, out, _ = run(capsys, "recommend", *mcore, "--seq-len", "8192", "--max-cp", "2")
    assert "cp not searched" not in out  # asked for: searched
    _, out, _ = run(capsys, "recommend", *mcore, "--seq-len", "16384")
    assert "cp not searched" not in out  # the default bound is 2 there
