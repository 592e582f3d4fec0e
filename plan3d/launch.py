"""Start a plan's ranks through torchrun (the only subprocess call of plan3d) and watch them.

On one machine `launch` starts every rank (static rendezvous on loopback); with nnodes > 1 it
starts this node's ranks. While torchrun runs, new lines of `metrics.jsonl` go to `on_progress`.
A failed rank (crash, collective timeout, placement mismatch) makes torchrun stop the others; the
result names the failing rank and its one-line error. Ctrl-C stops every rank; whatever happens,
the launcher's process group is killed before returning (workers also die with their parent).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from plan3d.emit.torchrun import WORKER_MODULE, node_command
from plan3d.errors import LaunchError
from plan3d.plan import Plan

STOP_GRACE_S = 10.0
AFTER_ERROR_S = 20.0
RANKS_NAMED = 8  # how many stopped ranks a hang message lists


@dataclass
class LaunchResult:
    exit_code: int
    run_dir: Path
    failed_rank: int | None = None
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def runtime_problems(plan: Plan) -> list[str]:
    """What the bundled runtime cannot run (each says what to change)."""
    layout, model = plan.layout, plan.model
    problems = []
    if layout.cp > 1 or layout.ep > 1:
        problems.append("the bundled runtime has no context or expert parallelism; set cp=1 and ep=1")
    if model.position == "alibi":
        problems.append("the bundled runtime has no ALiBi; use position: learned or rope")
    if model.vocab % layout.tp:
        problems.append(f"tp={layout.tp} does not divide vocab={model.vocab} (vocabulary-parallel output)")
    return problems


def node_layout(plan: Plan, nnodes: int, node_rank: int) -> int:
    """Ranks per node; raises when nnodes/node_rank cannot place the plan's world."""
    world, gpn = plan.layout.world_size, int(plan.rankmap["gpus_per_node"])
    nproc = min(world, gpn)
    if world % nproc or world // nproc != nnodes:
        need = -(-world // nproc)
        raise LaunchError(f"the plan's {world} ranks at {gpn} per node need --nnodes {need}, got {nnodes}"
                          + ("" if world % nproc == 0 else "; choose a world that fills whole nodes"))
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
    return nproc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(run_dir: Path, steps: int, backend: str, extra) -> list[str]:
    return ["--run-dir", str(run_dir), "--steps", str(steps), "--backend", backend, *map(str, extra)]


def prepare_run_dir(plan: Plan, run_dir: Path) -> Path:
    """Create the run directory, write plan.json, clear a previous attempt's errors."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    errors = run_dir / "errors"
    for stale in errors.glob("*.json") if errors.exists() else ():
        stale.unlink()
    plan_file = run_dir / "plan.json"
    _write_once(plan_file, plan.model_dump_json(indent=1))
    return plan_file


def _write_once(path: Path, text: str) -> None:
    """Atomic write through a private temp name: several launchers may share one run directory."""
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def launch(plan: Plan, plan_path: str | Path | None, run_dir: str | Path, steps: int, backend: str = "auto",
           nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int | None = None,
           worker_module: str = WORKER_MODULE, worker_args=(), on_progress: Callable[[dict], None] | None = None,
           env: dict | None = None) -> LaunchResult:
    """Run this node's ranks to the end; returns how it ended (never raises for a failed rank).

    A plan that spans several nodes, launched with nnodes=1 on loopback, runs every node's
    launcher on this machine (simulated nodes, each with its own node identity)."""
    problems = runtime_problems(plan)
    if problems:
        raise LaunchError("; ".join(problems))
    local_nodes = nnodes == 1 and master_addr in LOOPBACK and nodes_needed(plan) > 1
    nnodes = nodes_needed(plan) if local_nodes else nnodes
    nproc = node_layout(plan, nnodes, node_rank)
    run_dir = Path(run_dir)
    plan_file = prepare_run_dir(plan, run_dir)
    if master_port is None:
        if nnodes > 1 and not local_nodes:
            raise LaunchError("several nodes need the same --master-port on every node")
        master_port = free_port()
    args = worker_argv(run_dir, steps, backend, worker_args)
    nodes = range(nnodes) if local_nodes else [node_rank]
    jobs = [(node, node_command(str(plan_file), nnodes, nproc, node, master_addr, master_port, args, worker_module),
             _node_env(node, local_nodes, env)) for node in nodes]
    return _run(jobs, run_dir, on_progress)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def nodes_needed(plan: Plan) -> int:
    world, gpn = plan.layout.world_size, int(plan.rankmap["gpus_per_node"])
    return -(-world // min(world, gpn))


def _node_env(node: int, simulated: bool, extra: dict | None) -> dict:
    """The node's identity from the scheduler (SLURM) wins on a real node; the placement check
    compares it with the rank torchrun derived from --node-rank."""
    identity = str(node) if simulated else os.environ.get("PLAN3D_NODE_RANK", str(node))
    return {**os.environ, "PLAN3D_NODE_RANK": identity, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def _run(jobs, run_dir: Path, on_progress) -> LaunchResult:
    """Start one torchrun per (node, argv, env); wait for all; diagnose a failure."""
    start, procs, logs = time.monotonic(), [], []
    previous = _sigterm_as_interrupt()
    try:
        for node, cmd, env in jobs:
            logs.append(run_dir / "logs" / f"launcher{node}.log")
            with logs[-1].open("w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True, preexec_fn=_term_with_parent))
        code = _watch(procs, run_dir, on_progress)
    except KeyboardInterrupt:
        for proc in procs:
            _stop(proc)
        raise
    finally:
        for proc in procs:
            _kill_group(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result = LaunchResult(code, run_dir, elapsed_s=time.monotonic() - start)
    if code != 0:
        text = "\n".join(path.read_text(errors="replace") for path in logs)
        result.failed_rank, result.error = diagnose(run_dir, text)
    return result


def _term_with_parent() -> None:
    """In the child (Linux): SIGTERM torchrun if this launcher dies, so it stops its workers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_as_interrupt():
    """SIGTERM (scheduler cancel, kill) stops the ranks like Ctrl-C; only the main thread can."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def _watch(procs: list[subprocess.Popen], run_dir: Path, on_progress) -> int:
    """Poll the torchruns; forward metric records; after a failure give the others
    AFTER_ERROR_S to stop by themselves, then stop them. Returns the first non-zero exit."""
    metrics, seen, failed_since = run_dir / "metrics.jsonl", 0, None
    while True:
        codes = [proc.poll() for proc in procs]
        seen = _forward_metrics(metrics, seen, on_progress)
        bad = [c for c in codes if c not in (None, 0)]
        if all(c is not None for c in codes):
            return bad[0] if bad else 0
        if failed_since is None and (bad or any((run_dir / "errors").glob("*.json"))):
            failed_since = time.monotonic()
        if failed_since is not None and time.monotonic() - failed_since > AFTER_ERROR_S:
            for proc in procs:
                _stop(proc)
            return bad[0] if bad else 1
        time.sleep(0.2)


def _forward_metrics(path: Path, seen: int, on_progress) -> int:
    if on_progress is None or not path.exists():
        return seen
    lines = path.read_text().splitlines()
    complete = lines if path.read_text().endswith("\n") else lines[:-1]
    for line in complete[seen:]:
        on_progress(json.loads(line))
    return max(seen, len(complete))


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (torchrun stops its workers), then SIGKILL the whole group after a grace period."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)", re.M)


def failures_from_torchrun(launcher_log: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every failure block torchrun printed ('[i]:' blocks)."""
    out = []
    for block in re.split(r"^\[\d+\]:\s*$", launcher_log, flags=re.M)[1:]:
        fields = dict((k, int(v)) for k, v in _FIELD.findall(block))
        if "rank" in fields and "exitcode" in fields:
            out.append((fields["rank"], fields["exitcode"]))
    return out


def _hang_suspect(first: dict, errored: set[int], launcher_log: str) -> tuple[int, str]:
    """A collective timed out: the ranks torchrun had to stop without an error of their own hung."""
    stopped = sorted(rank for rank, code in failures_from_torchrun(launcher_log)
                     if code == -signal.SIGTERM and rank not in errored)
    if not stopped:
        return first["rank"], first["error"]
    names = ", ".join(map(str, stopped[:RANKS_NAMED])) + (" ..." if len(stopped) > RANKS_NAMED else "")
    return stopped[0], (f"rank {names} hung (never reached the collective that timed out on rank "
                        f"{first['rank']}: {first['error']})")


def diagnose(run_dir: Path, launcher_log: str) -> tuple[int | None, str]:
    """(failing rank, one-line error): a rank killed by a signal first, else the earliest error."""
    for rank, code in failures_from_torchrun(launcher_log):
        if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
            return rank, f"rank {rank} was killed by signal {signal.Signals(-code).name}"
    errors = []
    for path in (run_dir / "errors").glob("rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if errors:
        first = min(errors, key=lambda e: e["time"])
        if "timed out" in first["error"].lower():
            return _hang_suspect(first, {e["rank"] for e in errors}, launcher_log)
        return first["rank"], first["error"]
    tail = [line for line in launcher_log.splitlines() if line.strip()][-1:] or ["no output"]
    return None, f"torchrun failed: {tail[0][:300]} (see {run_dir / 'logs'})"


def predicted_model_state(plan: Plan, precision: str) -> dict[int, float]:
    """The memory model's model-state bytes per pipeline rank, for the precision the run used."""
    from plan3d.cost.memory import model_state_bytes

    training = plan.training.model_copy(update={"precision": precision})
    return {pp: sum(model_state_bytes(plan.model, training, plan.layout, pp).values())
            for pp in range(plan.layout.pp)}


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise LaunchError(f"the run finished without {path}; see {Path(run_dir) / 'logs'}")
    return json.loads(path.read_text())
