"""Hostile sizes are refused up front, in one line with exit 2, before anything large is built
(issue 19): rank-map listings and pictures, a plan file, --tokens, the calibrate sweep's flags."""
from __future__ import annotations

import time

import pytest

from cli_helpers import run_cli
from plan3d.layout import Layout


def _refused_fast(capsys, monkeypatch, *args, never_built=("plan3d.rankmap.rankmap_for",), within_s=5.0) -> str:
    """Exit 2, one line, quickly (~0.1 s for rankmap; generous bounds for a loaded machine), and nothing in `never_built` was called."""
    def never(*_, **__):
        raise AssertionError("built what the budget should have refused")

    for target in never_built:
        monkeypatch.setattr(target, never)
    start = time.perf_counter()
    code, out, err = run_cli(capsys, *args)
    assert time.perf_counter() - start < within_s
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


MILLION_RANKS = ("rankmap", "-c", "dgx-h100", "--tp", "8", "--nodes", "131072")


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_a_rank_listing_of_a_million_ranks_is_refused_up_front(capsys, monkeypatch, fmt):
    err = _refused_fast(capsys, monkeypatch, *MILLION_RANKS, "--format", fmt)
    assert "131,072" in err and "--nodes" in err and "--format table" in err


def test_an_svg_of_a_million_ranks_is_refused_up_front(capsys, monkeypatch, tmp_path):
    err = _refused_fast(capsys, monkeypatch, *MILLION_RANKS, "--svg", tmp_path / "m.svg")
    assert "4,096" in err and "--nodes" in err and not (tmp_path / "m.svg").exists()


def test_listings_at_the_budget_are_written(capsys, tmp_path):
    from plan3d.cli.rankmap_cmd import MAX_SVG_RANKS

    code, _, err = run_cli(capsys, "rankmap", "-c", "dgx-h100", "--tp", "8", "--nodes", MAX_SVG_RANKS // 8,
                           "--svg", tmp_path / "m.svg", "--format", "csv")
    assert code == 0, err
    assert (tmp_path / "m.svg").stat().st_size > 0


def test_the_table_of_a_million_ranks_builds_only_the_nodes_it_shows(capsys, monkeypatch):
    from plan3d.rankmap import RankMap
    from plan3d.render.rankmap import MAX_TABLE_NODES

    asked = []
    all_coords = RankMap.all_coords
    monkeypatch.setattr(RankMap, "all_coords", lambda self, limit=None: asked.append(limit) or all_coords(self, limit))
    code, out, err = run_cli(capsys, *MILLION_RANKS)
    assert code == 0, err
    assert asked == [MAX_TABLE_NODES * 8] and "131040 more nodes not shown" in out.replace("\n", " ")


@pytest.mark.parametrize("shape", [dict(tp=1), dict(tp=2, pp=2, dp=2), dict(tp=2, dp=4, cp=2, ep=2),
                                   dict(tp=4, pp=3, dp=6, cp=2, ep=4), dict(pp=4, dp=8, ep=8)])
def test_all_coords_match_a_naive_reading_of_the_groups(shape):
    """Every rank's coordinate on an axis is its place in its group of that axis (ep included)."""
    from plan3d.rankmap import RankMap

    rmap = RankMap(Layout(**shape), 4)
    coords = rmap.all_coords()
    assert [c.rank for c in coords] == list(range(rmap.world_size))
    for axis in ("tp", "cp", "ep", "dp", "pp"):
        for members in rmap.groups(axis):
            assert [getattr(coords[r], axis) for r in members] == list(range(len(members)))
    assert rmap.all_coords(limit=5) == coords[:5]


def _loader_count(value) -> int:
    """JSON values as the plan loader counts them: a list or mapping is one plus its items."""
    if isinstance(value, dict):
        return 1 + sum(_loader_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_loader_count(v) for v in value)
    return 1


@pytest.mark.parametrize("shape", [dict(tp=1), dict(tp=2, pp=2, dp=2), dict(tp=8, pp=16, dp=4),
                                   dict(tp=2, dp=4, cp=2, ep=2), dict(tp=4, pp=3, dp=6, cp=2, ep=4)])
def test_rankmap_json_values_counts_what_the_plan_holds(shape):
    from plan3d.plan import rankmap_dict
    from plan3d.rankmap import RankMap, rankmap_json_values

    layout = Layout(**shape)
    assert rankmap_json_values(layout) == _loader_count(rankmap_dict(RankMap(layout, 8)))


def test_a_plan_the_loader_would_refuse_is_not_written(capsys, monkeypatch, tmp_path):
    err = _refused_fast(capsys, monkeypatch, "recommend", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "100000",
                        "--global-batch", "1000000000", "--even", "--out", tmp_path / "plan.json",
                        never_built=("plan3d.plan.build_plan",), within_s=30.0)  # the search itself takes ~3 s
    assert "--out" in err and "32,768" in err and "--nodes" in err and not (tmp_path / "plan.json").exists()


def test_the_plan_budget_is_the_loaders(monkeypatch):
    """Past the plan loader's MAX_VALUES (plan3d.specs.loader) a plan is refused before it is built."""
    import plan3d.rankmap as rankmap
    from plan3d.errors import LayoutError
    from plan3d.specs.loader import MAX_VALUES

    layout = Layout(dp=100_000)
    monkeypatch.setattr(rankmap, "MAX_PLAN_RANKS", 10**9)
    rankmap.require_loadable_plan(layout)  # 2.6M values: fits
    monkeypatch.setattr(rankmap, "MAX_VALUES", rankmap.rankmap_json_values(layout))  # the loader's, as rankmap reads it
    with pytest.raises(LayoutError, match="more than a plan file may hold"):
        rankmap.require_loadable_plan(layout)
    assert MAX_VALUES == 20_000_000


def test_the_rest_of_a_plan_fits_its_reserve(tmp_path, capsys):
    import json

    from plan3d.rankmap import PLAN_OTHER_VALUES

    code, _, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "64",
                           "--out", tmp_path / "plan.json")
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    assert _loader_count(data) - _loader_count(data["rankmap"]) < PLAN_OTHER_VALUES / 10


@pytest.mark.parametrize("tokens", ["1e308", "1e17", "inf", "nan", "0", "-5"])
def test_recommend_tokens_is_bounded(capsys, tokens):
    code, _, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "1",
                           "--tokens", tokens)
    assert code == 2 and "--tokens" in err and "1e+16" in err and len(err.strip().splitlines()) == 1


def test_recommend_tokens_at_the_bound_is_shown(capsys):
    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "1",
                             "--tokens", "1e16", "--json")
    assert code == 0, err


@pytest.mark.parametrize("flags,needle", [
    (["--master-port", "70000"], "--master-port must be a port in 1..65535"),
    (["--master-port", "0"], "--master-port must be a port"),
    (["--master-addr", "$(id)"], "--master-addr must be a host name"),
    (["--max-bytes", "9223372036854775807"], "--max-bytes must be in 4096..17179869184"),
    (["--max-bytes", "100"], "--max-bytes must be in"),
    (["--repeats", "1000000000"], "--repeats must be in 1..10,000"),
    (["--repeats", "0"], "--repeats must be in"),
    (["--nproc", "100000"], "--nproc must be in 1..1,024"),
    (["--nnodes", "5000"], "--nnodes must be at most 1,024"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
    (["--backend", "mpi"], "--backend must be one of"),
    (["--tp", "1,2048"], "at most 16 values, each at most 1,024"),
    (["--micro-batch", ",".join(["1"] * 17)], "at most 16 values"),
    (["--nnodes", "1000", "--nproc", "1000", "--node-rank", "1"], "at most 131,072"),
])
def test_calibrate_bounds_every_numeric_flag(capsys, tmp_path, flags, needle):
    code, _, err = run_cli(capsys, "calibrate", "--run-dir", tmp_path / "run", *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_plan_file_over_the_plan_budget_is_refused_before_its_rank_map_is_checked(tmp_path, monkeypatch, capsys):
    """A plan listing more ranks than recommend --out writes (a hand-made or older one) is refused on load."""
    import plan3d.rankmap as rankmap
    from plan3d.errors import SpecError
    from plan3d.plan import load_plan

    code, _, err = run_cli(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--tp", "2", "--pp", "2", "--dp",
                           "2", "--precision", "fp32", "--top", "1", "--out", tmp_path / "plan.json")
    assert code == 0, err
    monkeypatch.setattr("plan3d.plan.MAX_PLAN_RANKS", 4)  # rankmap's, as the plan loader reads it
    with pytest.raises(SpecError, match="more than a plan may list"):
        load_plan(str(tmp_path / "plan.json"))
