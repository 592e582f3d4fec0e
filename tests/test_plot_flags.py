"""`recommend --plot` and `estimate --plot` write pictures of what they computed."""
import json

import pytest

pytest.importorskip("matplotlib")

from plan3d.render import recommend as render  # noqa: E402
from cli_helpers import run_cli  # noqa: E402


def run(args, capsys):
    return run_cli(capsys, *args)


def test_recommend_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "pareto.png"
    code, out, _ = run(["recommend", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "1", "--top", "2",
                        "--json", "--plot", str(path)], capsys)
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out)  # the JSON still goes to stdout


def test_pareto_points_mark_only_undominated_layouts():
    from plan3d import ranking, search
    from plan3d.cli.common import load_specs

    specs = load_specs("dgx-h100", "llama3-8b", 1, None, None, None)
    result = search.search(*specs, search.Space())
    points = render.pareto_points(result, ranking.rank(result, "throughput"))
    assert len(points) == result.feasible_count
    front = [p for p in points if p["pareto"]]
    assert front and all(p["label"] for p in front)
    for p in front:  # no feasible point is both faster and lighter than a front point
        assert not any(q["tokens_per_s"] > p["tokens_per_s"] and q["peak_memory_bytes"] < p["peak_memory_bytes"]
                       for q in points)


def test_estimate_plot_and_a_bad_suffix(tmp_path, capsys):
    path = tmp_path / "step.svg"
    code, _, _ = run(["estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "1", "--tp", "2",
                      "--plot", str(path)], capsys)
    assert code == 0 and "<svg" in path.read_text()
    code, _, err = run(["estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "1",
                        "--plot", str(tmp_path / "step.txt")], capsys)
    assert code == 2 and "use a .png, .svg or .pdf" in err
