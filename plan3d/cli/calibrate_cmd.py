"""`plan3d calibrate`: measure this machine, fit the cost model's efficiencies, write a cluster spec.

Two modes:
  plan3d calibrate [--backend auto|gloo|nccl] [--cluster local-cpu] [--out SPEC.yaml]
      micro-benchmarks (GEMMs, a memory-bound kernel, collectives) on --nproc ranks;
  plan3d calibrate --from-run RUN_DIR [--from-run RUN_DIR ...] [--out SPEC.yaml]
      rescale the compute throughput so the plans' predicted step times match the runs.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.calibrate import (calibrated_cluster, fit_measurements, fit_quality, message_sizes, refit_from_runs, row,
                              stamped, summary_rows, sweep_config, this_machine, unusable_fits, write_calibrated_spec)
from plan3d.cli.app import app
from plan3d.cost.estimate import estimate
from plan3d.errors import LaunchError, SpecError
from plan3d.run.launch import launch
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.rankmap import MAX_LISTED_RANKS
from plan3d.render.report import print_calibration, progress_while
from plan3d.render.units import json_text
from plan3d.run.record import read_run
from plan3d.run.flags import check_run_flags
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

DTYPE_OF = {"cpu": "fp32", "cuda": "bf16"}
# Bounds of the sweep's numeric flags (issue 19): a sweep past them would run for days or exhaust memory.
MAX_NPROC = 1_024  # ranks on one machine: more than any machine has cores or GPUs
MAX_NNODES = 1_024  # machines: the command is started on each by hand
MAX_SIZE = 1_024  # a --tp or --micro-batch value
MAX_LIST = 16  # values in a --tp or --micro-batch list
MAX_SWEEP_BYTES = 16 << 30  # largest collective message: 16 GiB, past any message a layer sends
MAX_REPEATS = 10_000  # timings per measurement


@app.command("calibrate")
def calibrate_command(
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster spec to calibrate (catalog values); with --from-run the plans' own spec is refitted.")] = "local-cpu",
    model: Annotated[str, typer.Option("--model", "-m", help="Model whose layer shapes the GEMM sweep uses.")] = "tiny-gpt",
    backend: Annotated[str, typer.Option("--backend", help="auto, gloo or nccl.")] = "auto",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Spec to write (YAML).")] = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Ranks to run (default: one node; at most 1,024).")] = None,
    tps: Annotated[str, typer.Option("--tp", help="Tensor-parallel sizes of the GEMM sweep (comma list of at most 16 values, each <= 1,024).")] = "1,2,4,8",
    micro_batches: Annotated[str, typer.Option("--micro-batch", help="Micro-batch sizes (comma list of at most 16 values, each <= 1,024).")] = "1,2,4,8",
    max_bytes: Annotated[int, typer.Option("--max-bytes", help="Largest collective message in bytes (4096 to 16 GiB).")] = 1 << 24,
    repeats: Annotated[int, typer.Option("--repeats", help="Timings per measurement (1 to 10,000).")] = 3,
    statistic: Annotated[str, typer.Option("--statistic", help="median, or min (best of --repeats: "
                                            "rejects interference on a shared machine).")] = "median",
    from_run: Annotated[Optional[list[Path]], typer.Option("--from-run", help="Refit from a launch's run dir.")] = None,
    fit_overheads: Annotated[bool, typer.Option("--fit-overheads", help="With --from-run: also fit the per-layer "
                                                "and per-micro-batch overheads (one knob per extra run).")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="Where the sweep writes (default runs/).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Machines taking part (run the command on each; at most 1,024).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This machine's index, 0..nnodes-1.")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", help="Address of node 0 (a host name, an IP address or one $VARIABLE).")] = "127.0.0.1",
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="Port on node 0, 1..65535 (same on every node).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the fit as JSON.")] = False,
) -> None:
    """Fit compute efficiency, memory bandwidth and per-tier bandwidth/latency on this machine."""
    if from_run:
        return _from_runs(from_run, out, json_out, fit_overheads)
    _check_sweep_flags(nproc, nnodes, node_rank, max_bytes, repeats, statistic,
                       {"master_addr": master_addr, "master_port": master_port, "backend": backend})
    tp_sizes, micro_batch_sizes = _ints(tps, "--tp"), _ints(micro_batches, "--micro-batch")
    base = load_cluster(cluster)
    per_node = nproc if nproc is not None else base.gpus_per_node  # --nproc 0 is an error, not the default
    _check_world(per_node, nnodes)
    device = _device(backend)
    # The ranks as they are placed: per_node on each of nnodes machines (the spec keeps its own size).
    placed = base.with_size(nodes=nnodes, gpus_per_node=per_node)
    world = per_node * nnodes
    nodes = {"nnodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port}
    run_dir = run_dir or Path("runs") / time.strftime("calibrate-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    raw = _measure(placed, model, device, backend, world, run_dir, tp_sizes, micro_batch_sizes,
                   max_bytes, repeats, nodes, statistic)
    if raw is None:
        return print(f"node {node_rank} done; node 0 writes the spec")
    _fit_and_write(base, raw, DTYPE_OF[device], out or run_dir / "cluster.yaml", json_out)


def _check_sweep_flags(nproc: int | None, nnodes: int, node_rank: int, max_bytes: int, repeats: int,
                       statistic: str, rendezvous: dict) -> None:
    """Every nonsense value is bad input before a rank starts or a run directory is made; the flags
    `launch` shares (nodes, rendezvous, backend) are checked by launch's own rules (`plan3d.run.flags`)."""
    smallest = message_sizes(1 << 62)[0]
    problems = [f"--{name} must be {rule}, got {value}" for name, value, ok, rule in (
        ("nproc", nproc, nproc is None or 1 <= nproc <= MAX_NPROC, f"in 1..{MAX_NPROC:,}"),
        ("nnodes", nnodes, nnodes <= MAX_NNODES, f"at most {MAX_NNODES:,}"),
        ("max-bytes", max_bytes, smallest <= max_bytes <= MAX_SWEEP_BYTES,
         f"in {smallest}..{MAX_SWEEP_BYTES} (4 KiB, the smallest message measured, to 16 GiB)"),
        ("repeats", repeats, 1 <= repeats <= MAX_REPEATS, f"in 1..{MAX_REPEATS:,}"),
        ("statistic", repr(statistic), statistic in ("median", "min"), "median or min"),
    ) if not ok]
    try:
        check_run_flags(nnodes=nnodes, node_rank=node_rank, **rendezvous)
    except SpecError as err:
        problems = err.problems + problems
    if problems:
        raise SpecError("command line", problems)


def _check_world(per_node: int, nnodes: int) -> None:
    if per_node * nnodes > MAX_LISTED_RANKS:
        raise SpecError("command line", [f"--nproc x --nnodes = {per_node * nnodes:,} ranks: at most "
                                         f"{MAX_LISTED_RANKS:,}; calibrate on fewer machines"])


def _ints(text: str, flag: str = "") -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecError("command line", [f"{flag} {text!r}: give a comma-separated list of integers, e.g. 1,2,4"]) from None
    if not values or min(values) < 1:
        raise SpecError("command line", [f"{flag} {text!r}: give positive integers, e.g. 1,2,4"])
    if len(values) > MAX_LIST or max(values) > MAX_SIZE:
        raise SpecError("command line", [f"{flag} {text!r}: give at most {MAX_LIST} values, each at most {MAX_SIZE:,}, "
                                         "e.g. 1,2,4"])
    return values


def _device(backend: str) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise SpecError("command line", [f"--backend {backend!r}: use auto, gloo or nccl"])
    if backend == "gloo":
        return "cpu"
    import torch  # lazy: only a measuring run needs torch (the planner installs without it)

    if torch.cuda.is_available():
        return "cuda"
    if backend == "nccl":
        raise LaunchError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    return "cpu"


def _measure(cluster, model_name, device, backend, world, run_dir, tps, mbs, max_bytes, repeats, nodes,
             statistic) -> dict | None:
    model = load_model(model_name)
    config = sweep_config(cluster, model, model.seq_len, world, device, tps, mbs, message_sizes(max_bytes), repeats)
    config["statistic"] = statistic
    if device == "cpu" and world > 1:
        config["threads"] = 1  # as torchrun sets OMP_NUM_THREADS=1 for several ranks per machine
    sweep_path = run_dir / "sweep.json"
    sweep_path.write_text(json_text(config))
    progress_while(lambda: _run_sweep(cluster, model, config, world, run_dir, backend, nodes), run_dir / "progress",
                   f"calibrating {world} ranks on {device}")
    record = run_dir / "calibration.json"
    return json.loads(record.read_text()) if record.exists() else None


def _run_sweep(cluster, model, config: dict, world: int, run_dir: Path, backend: str, nodes: dict) -> None:
    """Through the same launcher as training: a plan of `world` data-parallel ranks carries the
    placement; the calibration worker replaces the training worker."""
    plan = build_plan(cluster, model, TrainingSpec(global_batch=world), Layout(dp=world))
    result = launch(plan, None, run_dir, steps=0, backend=backend, nnodes=nodes["nnodes"],
                    node_rank=nodes["node_rank"], master_addr=nodes["master_addr"], master_port=nodes["master_port"],
                    worker_module="plan3d.runtime.calibrate_worker",
                    worker_args=["--sweep", str(run_dir / "sweep.json")])
    if not result.ok:
        where = f" (rank {result.failed_rank})" if result.failed_rank is not None else ""
        raise LaunchError(f"calibration failed{where}: {result.error or 'see ' + str(run_dir / 'logs')}")


def _fit_and_write(base, raw: dict, dtype: str, out: Path, json_out: bool) -> None:
    """Fit, judge each fit, write the spec; unusable fits are marked in the spec and warned about."""
    fit = fit_measurements(base, raw, dtype)
    quality = fit_quality(fit, [t.name for t in base.tiers()])
    unusable = unusable_fits(quality)
    machine = this_machine()
    source = (f"plan3d calibrate on {machine} ({raw['device']}/{raw['backend']}, {raw['world_size']} ranks), "
              f"{time.strftime('%Y-%m-%d')}; catalog: {base.name}")
    if unusable:
        source += f"; UNUSABLE FITS: {'; '.join(unusable)}"
    fitted = calibrated_cluster(base, fit, source, machine)
    measurements = write_calibrated_spec(fitted, raw, out, unusable)
    for line in unusable:
        print(f"warning: unusable fit, {line}: do not plan with {out} before calibrating again "
              "(more --repeats, --statistic min, an idle machine)", file=sys.stderr)
    _show(summary_rows(base, fitted, fit, dtype), out, measurements, json_out,
          {"name": fitted.name, "fit_quality": quality, "unusable": unusable})


def _show(rows: list[dict], out: Path, measurements: Path | None, json_out: bool, extra: dict | None = None) -> None:
    if json_out:
        print(json_text({"schema_version": 1, "spec": str(out),
                         "measurements": str(measurements) if measurements else None, "rows": rows, **(extra or {})}))
        return
    print_calibration(rows, out, measurements)


def _from_runs(run_dirs: list[Path], out: Optional[Path], json_out: bool, fit_overheads: bool) -> None:
    """Refit the compute throughput of each run's plan cluster from its measured step time."""
    runs = [read_run(d) for d in run_dirs]
    cluster = runs[0].plan.cluster
    other = next((r for r in runs[1:] if r.plan.cluster != cluster), None)
    if other is not None:
        raise SpecError(str(other.run_dir), [f"its plan's cluster spec differs from {runs[0].run_dir}'s; "
                                             "refit runs planned with one spec at a time"])

    def predict(candidate):
        return [estimate(candidate, r.plan.model, r.plan.training, r.plan.layout).step_time_s for r in runs]

    refit, fitted = refit_from_runs(cluster, predict, [r.measured_step_s for r in runs], fit_overheads)
    refit = stamped(refit, f"plan3d calibrate --from-run ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    out = out or run_dirs[0] / "cluster.yaml"
    raw = {"from_runs": [{"run_dir": str(r.run_dir), "layout": r.plan.layout.short(),
                          "measured_step_s": r.measured_step_s} for r in runs], "fit": fitted}
    measurements = write_calibrated_spec(refit, raw, out)
    _show(_refit_rows(cluster, refit, runs, predict, fitted), out, measurements, json_out, {"name": refit.name})


def _refit_rows(before, after, runs, predict, fitted: dict) -> list[dict]:
    b_eff, a_eff = before.gpu.compute_efficiency, after.gpu.compute_efficiency
    rows = [row("compute", "achieved FLOP/s multiplier", 1.0, fitted["throughput_scale"], "ratio"),
            row("compute", "max fraction of peak", b_eff.max_fraction, a_eff.max_fraction, "ratio"),
            *[row("compute", knob.removesuffix("_s").replace("_", " "), getattr(b_eff, knob), getattr(a_eff, knob), "s")
              for knob in fitted if knob.endswith("overhead_s")]]
    old, new = predict(before), predict(after)
    for run, p_old, p_new in zip(runs, old, new):
        rows.append(row(run.plan.layout.short(), f"step time (measured {run.measured_step_s * 1e3:.1f} ms)",
                         p_old, p_new, "s"))
    return rows
