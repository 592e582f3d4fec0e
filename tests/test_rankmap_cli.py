"""`plan3d rankmap` through the real entry point: formats, every bundled cluster, bad input."""
from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET

import pytest

from plan3d.specs.catalog import bundled_names, load_cluster
from cli_helpers import run_cli  # noqa: E402


run = run_cli


def test_json_has_every_rank_and_group(capsys):
    code, out, err = run(capsys, "rankmap", "--cluster", "gb200-nvl72", "--tp", "8", "--pp", "2", "--dp", "4",
                         "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["order"] == "tp-cp-ep-dp-pp" and data["world_size"] == 64
    gpn = load_cluster("gb200-nvl72").gpus_per_node
    assert [r["rank"] for r in data["ranks"]] == list(range(64))
    for rank in data["ranks"]:
        assert set(rank) == {"rank", "node", "local_rank", "tp", "pp", "dp", "cp", "ep"}
        assert (rank["node"], rank["local_rank"]) == divmod(rank["rank"], gpn)
        assert rank["rank"] == rank["tp"] + 8 * rank["dp"] + 32 * rank["pp"]
    assert data["groups"]["tp"][1] == list(range(8, 16))
    assert {p["name"]: p["tier_name"] for p in data["placement"]}["tp"] == "nvlink5"
    assert data["warnings"] == []


def test_csv_rows_match_json(capsys):
    args = ("rankmap", "--cluster", "dgx-h100", "--nodes", "2", "--tp", "4", "--pp", "2", "--order", "tp-cp-ep-pp-dp")
    _, out_json, _ = run(capsys, *args, "--format", "json")
    code, out_csv, err = run(capsys, *args, "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out_csv)))
    expected = json.loads(out_json)["ranks"]
    assert len(rows) == 16
    assert [{k: int(v) for k, v in row.items()} for row in rows] == expected


def test_table_and_svg(capsys, tmp_path):
    svg = tmp_path / "map.svg"
    code, out, err = run(capsys, "rankmap", "--cluster", "dgx-h100", "--nodes", "4", "--tp", "16", "--pp", "2",
                         "--svg", str(svg))
    assert code == 0, err
    assert "TP group spans 2 nodes" in out and "r31" in out
    root = ET.fromstring(svg.read_text())  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    cells = [r for r in root.iter(f"{ns}rect") if r.get("stroke")]  # the background has none
    assert len(cells) == 32
    fills = {c.get("fill") for c in cells}
    assert len(fills) == 2  # one colour per pipeline stage
    assert root.findall(f"{ns}line")  # TP outlines


@pytest.mark.parametrize("short", ["pp-dp", "tp-pp-dp"])
def test_short_order_places_ranks_like_the_full_one(capsys, short):
    base = ("rankmap", "--cluster", "dgx-h100", "--nodes", "2", "--tp", "4", "--pp", "2", "--format", "json")
    code, out_short, err = run(capsys, *base, "--order", short)
    assert code == 0, err
    _, out_full, _ = run(capsys, *base, "--order", "tp-cp-ep-pp-dp")
    assert json.loads(out_short) == json.loads(out_full)
    assert json.loads(out_short)["order"] == "tp-cp-ep-pp-dp"


def test_smaller_layout_uses_the_first_gpus(capsys):
    code, out, err = run(capsys, "rankmap", "--cluster", "dgx-a100-80g", "--tp", "8", "--dp", "2", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["world_size"] == 16
    _, table, _ = run(capsys, "rankmap", "--cluster", "dgx-a100-80g", "--tp", "8", "--dp", "2")
    assert "first 16 of the cluster's" in table


@pytest.mark.parametrize("name", bundled_names("cluster"))
def test_every_bundled_cluster(capsys, name):
    code, out, err = run(capsys, "rankmap", "--cluster", name, "--format", "csv")
    assert code == 0, err
    assert len(out.splitlines()) == load_cluster(name).world_size + 1


@pytest.mark.parametrize("args, expect", [
    (("--order", "tp-cp-ep-dp-zz"), "unknown axis 'zz'"),
    (("--order", "tp-dp-dp-cp-pp"), "repeated axis 'dp'"),
    (("--order", "tp-dp-xx"), "unknown axis 'xx'"),
    (("--tp", "3"), "does not divide the cluster's 16 GPUs"),
    (("--tp", "8", "--pp", "2", "--dp", "2"), "exceeds the cluster's 16 GPUs"),
    (("--tp", "0"), "positive"),
    (("--nodes", "0"), "--nodes must be a positive integer"),
    (("--format", "xml"), "--format 'xml'"),
    (("--tp", "2", "--dp", "2", "--ep", "3"), "ep=3 must divide"),
])
def test_bad_input_exits_2_with_an_example(capsys, args, expect):
    code, out, err = run(capsys, "rankmap", "--cluster", "dgx-h100", "--nodes", "2", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], err
    assert "Traceback" not in err
    if "order" in args[0] or "GPUs" in expect:
        assert "e.g." in lines[0]


def test_unknown_cluster_suggests_the_closest(capsys):
    code, _, err = run(capsys, "rankmap", "--cluster", "dgx-h10")
    assert code == 2 and "did you mean 'dgx-h100'" in err


def test_unwritable_svg_path(capsys, tmp_path):
    code, _, err = run(capsys, "rankmap", "--cluster", "local-cpu", "--svg", str(tmp_path / "no" / "dir" / "x.svg"))
    assert code == 2 and "cannot be written" in err and "Traceback" not in err


@pytest.mark.parametrize("degrees", [("--tp", "4", "--pp", "3"), ("--tp", "2", "--pp", "12", "--dp", "1"),
                                     ("--tp", "2", "--cp", "2", "--ep", "2", "--pp", "2")])
def test_svg_legend_names_every_axis_and_each_stage_colour(capsys, tmp_path, degrees):
    svg = tmp_path / "map.svg"
    code, _, err = run(capsys, "rankmap", "--cluster", "dgx-h100", "--nodes", "3", *degrees, "--format", "json",
                       "--svg", str(svg))
    assert code == 0, err
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg.read_text())
    [legend] = [g for g in root.iter(f"{ns}g") if g.get("id") == "legend"]
    text = " ".join(t.text for t in legend.iter(f"{ns}text"))
    flags = dict(zip(degrees[::2], degrees[1::2]))
    sizes = {axis: int(flags.get(f"--{axis}", 1)) for axis in ("tp", "pp", "cp", "ep")}
    for axis, size in sizes.items():
        assert f"{axis}={size}" in text
    assert "dp=" in text and f"group of {sizes['tp']} rank" in text
    stage_fill = {}  # the fill of every cell, by the pipeline stage its text names
    for rect, label in zip([r for r in root.iter(f"{ns}rect") if r.get("stroke")],
                           [t for t in root.iter(f"{ns}text") if t.get("class") == "c"]):
        stage_fill.setdefault(int(label.text.split(" p")[1].split()[0]), set()).add(rect.get("fill"))
    swatches = [r for r in legend.iter(f"{ns}rect") if r.get("class") == "swatch"]
    assert len(swatches) == min(sizes["pp"], 10)
    for stage, swatch in enumerate(swatches):
        assert stage_fill[stage] == {swatch.get("fill")}
        assert float(swatch.get("x")) + 14 <= float(root.get("width"))
