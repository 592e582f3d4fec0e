"""Helpers of the multi-process runtime tests (CPU, gloo, tiny-gpt, a few steps).

What a launched run costs on CPU is mostly start-up: torchrun and every rank import torch
(about 3-4 s of CPU each), while a tiny-gpt step takes milliseconds. So the launched tests use
as few ranks and launches as the property needs, and one launch checks everything it can: the
losses, every rank's model-state bytes, its mesh groups, the phase timings, the files it wrote.
"""
from __future__ import annotations

import json
from pathlib import Path

STEPS = 4
TOL = 1e-5
TOKEN_DATA = ["--data", "python-docs"]  # the bundled text (byte tokens), for runs on real data


def make_plan(nodes: int | None = None, gpus_per_node: int | None = None, engine=None, **layout_flags):
    """A tiny-gpt plan on the local CPU cluster (for `engine`, default none). Without `micro_batch`,
    each step has two micro-batches per pipeline stage (see `few_micro_batches`)."""
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.layout import check_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("local-cpu", "tiny-gpt", nodes, gpus_per_node, None, None, "fp32")
    if layout_flags.get("micro_batch") is None:
        layout_flags["micro_batch"] = few_micro_batches(training.global_batch, layout_flags.get("dp") or 1,
                                                        layout_flags.get("pp") or 1)
    layout = make_layout(**layout_flags)
    check_layout(layout, model, training, cluster.world_size)
    return build_plan(cluster, model, training, layout, {}, engine)


def few_micro_batches(global_batch: int, dp: int, pp: int) -> int:
    """The micro-batch size that gives 2*pp micro-batches a step (1F1B still reaches its steady
    state, every rank still accumulates gradients over two or more), or 1 when that does not
    divide. The launched tests' steps cost mostly per-micro-batch overhead and one collective per
    micro-batch and layer, so sequences of 1 (16 micro-batches) made each step several times
    slower; the sum of the gradients, hence the loss, does not depend on the split (seen: within
    1e-6 of micro-batches of 1)."""
    per_stage = global_batch // (2 * pp * dp)
    return per_stage if per_stage and global_batch % (2 * pp * dp) == 0 else 1


def llama_style(plan):
    """tiny-gpt reshaped like Llama: GQA (2 kv heads), SwiGLU, RMSNorm, RoPE, no biases, tied embeddings."""
    from plan3d.plan import build_plan

    model = plan.model.model_copy(update=dict(name="tiny-llama", kv_heads=2, activation="swiglu", ffn_hidden=128,
                                              norm="rmsnorm", bias=False, position="rope", tied_embeddings=True))
    return build_plan(plan.cluster, model, plan.training, plan.layout, {}, plan.engine)


def run(plan, run_dir: Path, steps: int = STEPS, extra=(), **kwargs):
    from plan3d.run.launch import launch

    return launch(plan, None, run_dir, steps, worker_args=["--timeout-s", "60", *extra], **kwargs)


def launched(plan, run_dir: Path, extra=("--no-save",), **kwargs) -> list[dict]:
    """Run the plan to the end (it must succeed); every rank's record of summary.json."""
    result = run(plan, run_dir, extra=list(extra), **kwargs)
    assert result.ok, f"{result.failed_rank}: {result.error}"
    return summary(run_dir)["ranks"]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= TOL, f"step {step}: {got[step]} vs single process {want[step]}"


def check_model_state(plan, ranks: list[dict]) -> None:
    """Every rank's measured model-state bytes are the memory model's prediction within 1%."""
    from plan3d.cost.memory import model_state_bytes

    assert len(ranks) == plan.layout.world_size
    for r in ranks:
        want = model_state_bytes(plan.model, plan.training, plan.layout, r["pp"])
        for kind in ("weights", "gradients", "optimizer"):
            got = r["model_state_bytes"][kind]
            assert abs(got - want[kind]) <= 0.01 * want[kind], f"rank {r['rank']} {kind}: {got} vs model {want[kind]}"


def check_mesh_groups(plan, ranks: list[dict], dims=("tp", "dp", "pp")) -> None:
    """The DeviceMesh built from the rank map holds exactly the plan's groups."""
    for dim in dims:
        got = sorted({tuple(r["mesh_groups"][dim]) for r in ranks})
        assert got == sorted(tuple(g) for g in plan.rankmap.groups[dim]), dim


def check_phases(run_dir: Path) -> None:
    """Every step record carries its phase timings, and they add up to the step time."""
    for record in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()):
        phases = record["phases_s"]
        assert set(phases) == {"forward_backward", "grad_reduce", "clip", "optimizer", "loss"}
        assert all(v >= 0 for v in phases.values())
        assert abs(sum(phases.values()) - record["step_time_s"]) < 1e-3 * record["step_time_s"]


def check_completed_run(plan, run_dir: Path, reference: dict[int, float], steps=range(1, STEPS + 1)) -> list[dict]:
    """A finished run: its losses are one process's, and every rank's model-state bytes, mesh
    groups and phase timings are right. Returns the ranks' records."""
    assert_same_losses(metrics(run_dir), reference, steps)
    ranks = summary(run_dir)["ranks"]
    check_model_state(plan, ranks)
    check_mesh_groups(plan, ranks)
    check_phases(run_dir)
    return ranks
