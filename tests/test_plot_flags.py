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


# ---- the pictures say the answer: which layout, and whether it fits ------------------------------
def figure_texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    return [t for t in texts if t]


@pytest.fixture(scope="module")
def ranked_points():
    from plan3d import ranking, search
    from plan3d.cli.common import load_specs

    specs = load_specs("dgx-h100", "llama3-8b", 2, None, None, None)
    result = search.search(*specs, search.Space())
    return render.pareto_points(result, ranking.rank(result, "throughput")), float(result.metrics["capacity_bytes"][0])


def test_pareto_figure_stars_and_names_the_chosen_layout(ranked_points):
    from plan3d.render.plots import chosen_text, pareto_figure

    points, capacity = ranked_points
    for chosen in (0, next(i for i, p in enumerate(points) if p["pareto"] and i > 0)):
        fig = pareto_figure(points, capacity, chosen)
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert chosen_text(points, chosen) in legend and points[chosen]["label"] in chosen_text(points, chosen)
        [star] = [c for c in ax.collections if c.get_paths() and c.get_offsets().shape == (1, 2)]
        x, y = star.get_offsets()[0]
        assert (x, y) == pytest.approx((points[chosen]["peak_memory_bytes"] / 2**30, points[chosen]["tokens_per_s"]))
        assert points[chosen]["label"] in " ".join(figure_texts(fig))  # also in the key panel


def test_pareto_front_letters_are_keyed_and_clear_of_each_other_and_the_front(ranked_points):
    from plan3d.render.plots import pareto_figure

    points, capacity = ranked_points
    fig = pareto_figure(points, capacity)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    letters = [t for t in ax.texts if (t.get_gid() or "").startswith("front-label-")]
    assert len(letters) >= 3
    key = next(t for t in fig.axes[1].texts if t.get_gid() == "front-key").get_text()
    front_line = next(line for line in ax.get_lines() if line.get_label() == "Pareto front")
    front_xy = ax.transData.transform(front_line.get_xydata())
    boxes = [t.get_window_extent(renderer) for t in letters]
    for text, box in zip(letters, boxes):
        x, y = text.xy  # the point it names is a front point, listed in the key under its letter
        label = next(p["label"] for p in points if (p["peak_memory_bytes"] / 2**30, p["tokens_per_s"]) == (x, y))
        assert f"{text.get_text()}  {label}\n" in key
        for a, b in zip(front_xy, front_xy[1:]):  # no letter sits on the front line or its markers
            assert not any(box.contains(*(a + (b - a) * f)) for f in [k / 40 for k in range(41)])
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1:])


def test_pareto_figure_without_a_pick_has_no_star(ranked_points):
    from plan3d.render.plots import pareto_figure

    points, capacity = ranked_points
    legend = [t.get_text() for t in pareto_figure(points, capacity, chosen=None).axes[0].get_legend().get_texts()]
    assert not any("chosen" in t for t in legend)


@pytest.mark.parametrize("capacity_factor", [0.8, 1.25])
def test_step_figure_names_the_layout_and_says_whether_it_fits(capacity_factor):
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.render.estimate import TIME_LABELS
    from plan3d.render.plots import step_figure

    cluster, model, training = load_specs("dgx-h100", "llama3-8b", 1, None, None, None)
    est = estimate(cluster, model, training, make_layout(tp=2, pp=2, dp=2)).to_dict()
    capacity = est["peak_memory_bytes"] * capacity_factor  # the same estimate on a smaller / larger GPU
    est |= {"capacity_bytes": capacity, "fits": capacity >= est["peak_memory_bytes"]}
    fig = step_figure(est, title="llama3-8b on dgx-h100")
    texts = figure_texts(fig)
    assert f"llama3-8b on dgx-h100: {Layout(**est['layout']).short()}" in texts
    verdict = "fits" if est["fits"] else "does not fit"
    memory = f"{est['peak_memory_bytes'] / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB usable: {verdict}"
    assert any(memory in t for t in texts), texts
    time_legend = " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    for term, value_s in est["time_s"].items():  # every term of the step is in the bar and named
        assert (value_s > 0) == (TIME_LABELS[term] in time_legend), term
