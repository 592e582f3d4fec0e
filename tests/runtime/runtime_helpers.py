"""Helpers of the multi-process runtime tests (CPU, gloo, tiny-gpt, a few steps)."""
from __future__ import annotations

import json
from pathlib import Path

STEPS = 4
TOL = 1e-5


def make_plan(nodes: int | None = None, gpus_per_node: int | None = None, **layout_flags):
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.layout import check_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("local-cpu", "tiny-gpt", nodes, gpus_per_node, None, None, "fp32")
    layout = make_layout(**layout_flags)
    check_layout(layout, model, training, cluster.world_size)
    return build_plan(cluster, model, training, layout, {})


def run(plan, run_dir: Path, steps: int = STEPS, extra=(), **kwargs):
    from plan3d.launch import launch

    return launch(plan, None, run_dir, steps, worker_args=["--timeout-s", "60", *extra], **kwargs)


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= TOL, f"step {step}: {got[step]} vs single process {want[step]}"
