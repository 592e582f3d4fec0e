"""`plan3d launch`: run a plan (or a layout given by flags) with the bundled runtime (issue 6)."""
from __future__ import annotations

import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.cli.app import app
from plan3d.cli.common import (DEFAULT_ORDER, ClusterOpt, CpOpt, GlobalBatchOpt, GpnOpt, MicroBatchOpt, ModelOpt,
                               NodesOpt, OrderOpt, PpOpt, RecomputeOpt, SeqLenOpt, SeqParallelOpt, TpOpt,
                               ScheduleOpt, VppOpt, ZeroOpt, load_specs, make_layout)
from plan3d.errors import InfeasibleError, LaunchError, LayoutError, Plan3dError
from plan3d.run.flags import check_run_flags

PREVIOUS_RUN = ("metrics.jsonl", "segments.jsonl", "summary.json", "plans", "checkpoints", "errors",
                "logs")  # what --overwrite removes
PlanArg = Annotated[Optional[str], typer.Argument(help="Plan JSON (`plan3d recommend --out FILE`); omit to use the flags.")]


def _plan_from_flags(cluster, model, nodes, gpus_per_node, global_batch, seq_len, precision, layout_flags,
                     cp_comm=None):
    """A plan of the flags' layout, predicted for plan3d's own runtime (what launch trains with)."""
    from plan3d.cost.estimate import estimate
    from plan3d.layout import check_layout
    from plan3d.plan import build_plan
    from plan3d.specs.catalog import RUNTIME_ENGINE, load_engine
    from plan3d.specs.training import with_precision

    cluster_spec, model_spec, training = load_specs(cluster, model, nodes, gpus_per_node, global_batch,
                                                    seq_len, precision)
    training = with_precision(training, cluster_spec.gpu, precision)
    layout = make_layout(**layout_flags)
    check_layout(layout, model_spec, training, cluster_spec.world_size)
    engine = load_engine(RUNTIME_ENGINE).with_cp_comm(cp_comm)
    return build_plan(cluster_spec, model_spec, training, layout,
                      estimate(cluster_spec, model_spec, training, layout, engine).to_dict(), engine)


def _default_run_dir(plan, nnodes: int) -> str:
    """runs/<time>-<layout>; with several nodes one name every node derives alike (the digest)."""
    layout = plan.layout.short().replace(" ", "-")
    stamp = plan.digest if nnodes > 1 else time.strftime("%Y%m%d-%H%M%S")
    return f"runs/{stamp}-{layout}"


def _holds_a_run(run_path: Path) -> bool:
    """A previous launch wrote steps here: starting afresh would overwrite its metrics and checkpoints."""
    metrics = run_path / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def _clear_previous_run(run_path: Path) -> None:
    """--overwrite: remove a previous run's metrics, summary, checkpoints, errors and logs."""
    for name in PREVIOUS_RUN:
        path = run_path / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _checked_resume(run_path: Path, run_dir: str | None, resume: bool, resume_from: str | None,
                    overwrite: bool) -> str | None:
    """The checkpoint to resume from, verified before any rank starts (None: a fresh start)."""
    from plan3d.run.checkpoints import verified

    if resume and overwrite:
        raise Plan3dError("--resume continues a run and --overwrite discards it: pass only one")
    if resume and not run_dir:
        raise Plan3dError("--resume continues a run: pass its --run-dir (or use --resume-from)")
    if resume_from and not Path(resume_from).exists():
        raise Plan3dError(f"--resume-from {resume_from}: no such checkpoint or run directory")
    if resume and not run_path.is_dir():
        raise Plan3dError(f"--resume: {run_path} does not exist; give the --run-dir of the run to continue")
    source = resume_from or (str(run_path) if resume else None)
    return str(verified(Path(source))) if source else None


def interrupt_advice(run_path: Path) -> str:
    """What will work after Ctrl-C: --resume when a checkpoint exists, else a fresh start."""
    from plan3d.run.checkpoints import CheckpointError, resolve

    try:
        checkpoint = resolve(run_path)
    except CheckpointError:
        return (f"no checkpoint was saved yet: start afresh with --overwrite --run-dir {run_path} "
                "(or another --run-dir)")
    return f"last checkpoint {checkpoint.name} (resume with --resume --run-dir {run_path})"


def _worker_args(save_every: int, resume_from: str | None, timeout_s: float, seed: int, keep_last: int,
                 data: str | None = None) -> list[str]:
    args = ["--save-every", str(save_every), "--timeout-s", str(timeout_s), "--seed", str(seed)]
    args += ["--keep-last", str(keep_last)] if keep_last else []
    args += ["--data", data] if data else []
    return args + (["--resume-from", resume_from] if resume_from else [])


@app.command("launch")
def launch_command(
    plan_file: PlanArg = None,
    steps: Annotated[int, typer.Option("--steps", help="Train up to this step.")] = 10,
    backend: Annotated[str, typer.Option("--backend", help="auto, gloo or nccl.")] = "auto",
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="Default runs/<time>-<layout>.")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes taking part (one launcher each).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's rank, 0..nnodes-1.")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", help="Node 0's address.")] = "127.0.0.1",
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="Default: a free port (one node) or 29500.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every node's command and exit.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --run-dir's last checkpoint.")] = False,
    resume_from: Annotated[Optional[str], typer.Option("--resume-from", help="Checkpoint or run directory (any layout).")] = None,
    save_every: Annotated[int, typer.Option("--save-every", help="Checkpoint every N steps (0: at the end only).")] = 0,
    keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the newest N checkpoints (0: all).")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start afresh in a --run-dir that holds a run "
                                                                "(its metrics, checkpoints and logs are deleted).")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Collective and rendezvous timeout: a hung rank "
                                                                 "or a missing node ends the job.")] = 300.0,
    seed: Annotated[int, typer.Option("--seed", help="Weights and data seed.")] = 1234,
    data: Annotated[Optional[str], typer.Option("--data", help="Train on a token file (nanoGPT .bin, Megatron "
                                                "PREFIX.bin) or a bundled corpus (python-docs); default: "
                                                "synthetic tokens.")] = None,
    cluster: ClusterOpt = "local-cpu", model: ModelOpt = "tiny-gpt",
    tp: TpOpt = 1, pp: PpOpt = 1, dp: Annotated[int, typer.Option("--dp", help="Data-parallel degree.")] = 1,
    cp: CpOpt = 1,
    cp_comm: Annotated[Optional[str], typer.Option("--cp-comm", help="K/V exchange with cp > 1 for a layout given "
                                                   "by flags: all_gather (default) or p2p (ring attention); a plan "
                                                   "file runs its own.")] = None,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel degree of an MoE model: each ep rank holds "
                                    "experts/ep experts; carved out of dp*cp (must divide it).")] = 1,
    micro_batch: MicroBatchOpt = 1, global_batch: GlobalBatchOpt = None, seq_len: SeqLenOpt = None,
    vpp: VppOpt = 1, schedule: ScheduleOpt = None, zero: ZeroOpt = 0, recompute: RecomputeOpt = "none",
    sequence_parallel: SeqParallelOpt = False, order: OrderOpt = DEFAULT_ORDER,
    nodes: NodesOpt = None, gpus_per_node: GpnOpt = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="Default fp32 on CPU clusters, else bf16.")] = None,
    allow_oversubscribe: Annotated[bool, typer.Option("--allow-oversubscribe", help="Start a layout whose predicted "
                                                      "peak memory per rank exceeds the cluster's memory per rank "
                                                      "(refused otherwise, a dry run too).")] = False,
) -> None:
    """Train a plan's layout with the bundled runtime; print measured against predicted."""
    from plan3d.run.launch import checked_data, memory_problem, runtime_problems
    from plan3d.plan import load_plan

    check_run_flags(steps=steps, nnodes=nnodes, node_rank=node_rank, save_every=save_every, timeout_s=timeout_s,
                    master_port=master_port, backend=backend, keep_last=keep_last, master_addr=master_addr)
    if plan_file:
        if cp_comm is not None:
            raise LayoutError(f"--cp-comm applies to a layout given by flags; {plan_file} runs the exchange it was "
                              f"planned with: re-plan with --cp-comm {cp_comm}")
        plan = load_plan(plan_file)
    else:
        flags = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, micro_batch=micro_batch, vpp=vpp, schedule=schedule, zero=zero,
                     recompute=recompute,
                     sequence_parallel=sequence_parallel, order=order)
        plan = _plan_from_flags(cluster, model, nodes, gpus_per_node, global_batch, seq_len, precision, flags,
                                cp_comm)
    unsupported = runtime_problems(plan)  # before the memory check and a dry run: what cannot run at all
    if unsupported:
        raise LaunchError("; ".join(unsupported))
    problem = None if allow_oversubscribe else memory_problem(plan)
    if problem:
        raise InfeasibleError(problem)
    run_path = Path(run_dir or _default_run_dir(plan, nnodes))
    resume_from = _checked_resume(run_path, run_dir, resume, resume_from, overwrite)
    data_path = checked_data(plan, data) if data else None
    worker_args = _worker_args(save_every, resume_from, timeout_s, seed, keep_last, data_path)
    if master_port is None and nnodes > 1:
        master_port = 29500
    if dry_run:
        return _print_dry_run(plan, run_path, steps, backend, nnodes, master_addr, master_port, worker_args, timeout_s)
    if not resume and _holds_a_run(run_path):
        if not overwrite:
            raise Plan3dError(f"{run_path} already holds a run (metrics.jsonl): pass --resume to continue it, "
                              "--overwrite to start afresh there, or choose another --run-dir")
        if node_rank == 0:
            _clear_previous_run(run_path)
    _launch_and_report(plan, run_path, steps, backend, nnodes, node_rank, master_addr, master_port, worker_args)


def _print_dry_run(plan, run_path, steps, backend, nnodes, master_addr, master_port, worker_args, timeout_s) -> None:
    from plan3d.emit.torchrun import torchrun_commands
    from plan3d.run.launch import LOOPBACK, nodes_needed, node_layout, worker_argv
    from plan3d.run.compare import engine_note

    if nnodes == 1 and master_addr in LOOPBACK:
        nnodes = nodes_needed(plan)  # simulated nodes on this machine, as launch() does
    gpn = node_layout(plan, nnodes, 0)
    cmds = torchrun_commands(str(run_path / "plan.json"), plan.layout.world_size, nnodes, gpn, master_addr,
                             master_port or 29500, worker_argv(run_path, steps, backend, worker_args),
                             rdzv_timeout_s=timeout_s)
    if engine_note(plan):
        print(f"# {engine_note(plan)}")
    for node, cmd in enumerate(cmds):
        print(f"# node {node}: PLAN3D_NODE_RANK={node}")
        print(shlex.join(cmd))


def _launch_and_report(plan, run_path, steps, backend, nnodes, node_rank, master_addr, master_port, worker_args):
    from plan3d.run.launch import launch
    from plan3d.render.launch import progress_bar

    try:
        with progress_bar(steps) as on_progress:
            result = launch(plan, None, run_path, steps, backend=backend, nnodes=nnodes, node_rank=node_rank,
                            master_addr=master_addr, master_port=master_port, worker_args=worker_args,
                            on_progress=on_progress)
    except KeyboardInterrupt:
        print(f"interrupted: stopped all ranks; {interrupt_advice(run_path)}", file=sys.stderr)
        raise SystemExit(130)
    if not result.ok:
        where = f"rank {result.failed_rank}" if result.failed_rank is not None else "the job"
        raise LaunchError(f"{where} failed: {result.error} (exit {result.exit_code}; logs in {run_path / 'logs'})")
    if node_rank != 0:
        print(f"node {node_rank} done; node 0 holds the summary in {run_path}")
        return
    _print_end(run_path)


def _print_end(run_path: Path) -> None:
    """What `plan3d report RUN_DIR` prints, after the run's losses: one table, one pairing."""
    from plan3d.render.launch import print_launch_end
    from plan3d.run.compare import compare
    from plan3d.run.record import read_run

    run = read_run(run_path)
    if run.summary.get("incomplete"):
        raise LaunchError(f"the run finished without {run_path / 'summary.json'}; see {run_path / 'logs'}")
    print_launch_end(run.summary, compare(run), str(run_path))
