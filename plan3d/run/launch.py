"""Start a plan's ranks through torchrun (the only subprocess call of plan3d) and watch them.

On one machine `launch` starts every rank (static rendezvous on loopback); with nnodes > 1 it
starts this node's ranks. While torchrun runs, new lines of `metrics.jsonl` go to `on_progress`.
A failed rank (crash, collective timeout, placement mismatch) makes torchrun stop the others; the
result names the failing rank and its one-line error. Ctrl-C stops every rank; whatever happens,
the launcher's process group is killed before returning (workers also die with their parent).

Every wait is bounded by the launch timeout (`--timeout-s` of the workers): the collectives, and
torchrun's static rendezvous (node 0 waiting for the other nodes, a node waiting for node 0).
What the ranks cannot report (a full disk, a port in use, a node that never joined) is diagnosed
here, from the launcher's side.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from plan3d.emit.torchrun import WORKER_MODULE, node_command
from plan3d.errors import (
    LaunchError,
    SpecError,
    os_error_message,
    refuse_special_target,
)
from plan3d.plan import Plan
from plan3d.run.limits import runtime_problems  # noqa: F401  (re-exported)
from plan3d.run.compare import predicted_for_run
from plan3d.run.record import PLAN, is_digest, plan_path
from plan3d.run.tokens import BUNDLED, open_tokens

STOP_GRACE_S = 10.0
AFTER_ERROR_S = 20.0
RANKS_NAMED = 8  # how many hung ranks a message lists
DEFAULT_TIMEOUT_S = 300.0
MIN_FREE_BYTES = 64 * 2**20  # below this the run directory's disk counts as full
PORT_TRIES = 3  # fresh ports tried when the port was ours to pick and another process took it


@dataclass
class LaunchResult:
    exit_code: int
    run_dir: Path
    failed_rank: int | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    port_taken: bool = False  # torchrun could not listen on the rendezvous port

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def predicted_memory(plan: Plan) -> tuple[float, float, int]:
    """(peak bytes of the fullest rank, usable bytes per rank, its pipeline rank): the plan's own
    estimate, or the prediction for plan3d's runtime (plan3d/run/compare.py) when it carries none."""
    est = plan.estimate  # None: a plan made without an estimate
    if est is None or est.capacity_bytes is None:
        est = predicted_for_run(plan)
    return float(est.peak_memory_bytes), float(est.capacity_bytes), int(est.worst_pp_rank or 0)


def memory_problem(plan: Plan) -> str | None:
    """Why the plan's ranks would not fit in memory, or None. Per rank against the device memory of
    the cluster spec less its reserve (a CPU cluster's spec gives each rank process its share of
    host memory the same way; no spec holds a node's host memory as a whole)."""
    peak, usable, worst = predicted_memory(plan)
    if peak <= usable:
        return None
    gpu, gib = plan.cluster.gpu, 2**30
    return (f"{plan.layout.short()} does not fit: the plan predicts {peak / gib:.1f} GiB on pipeline rank {worst} "
            f"against {usable / gib:.1f} GiB usable of the {gpu.memory_gib:g} GiB per rank ({gpu.name}) of "
            f"{plan.cluster.name}, so the ranks would exhaust memory; choose a layout that fits (plan3d recommend) "
            "or pass --allow-oversubscribe to start it anyway")


def node_layout(plan: Plan, nnodes: int, node_rank: int) -> int:
    """Ranks per node; raises when nnodes/node_rank cannot place the plan's world."""
    world, gpn = plan.layout.world_size, plan.gpus_per_node
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


def port_in_use(addr: str, port: int) -> bool:
    """Whether something already listens on addr:port here (False when addr is not this host's)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def port_in_use_message(addr: str, port: int, nnodes: int) -> str:
    node0 = (" (or a second launcher was given --node-rank 0: every node needs its own --node-rank)"
             if nnodes > 1 else "")
    return (f"port {port} on {addr} is already in use by another process{node0}; "
            "pass a free --master-port (the same on every node)")


def timeout_from(worker_args) -> float:
    """The workers' --timeout-s (the last one given, as argparse reads it), which also bounds
    the launcher's own waits."""
    args = list(map(str, worker_args))
    values = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--timeout-s"]
    return float(values[-1]) if values else DEFAULT_TIMEOUT_S


def check_free_space(run_dir: Path) -> None:
    """Refuse to start on a full disk: the ranks could not even write why they failed."""
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise LaunchError(disk_full_message(run_dir, free))


def disk_full_message(run_dir: Path, free: int) -> str:
    return (f"no space left on the disk holding {run_dir} ({free / 2**20:.0f} MiB free); "
            "free space, lower --keep-last, or choose a --run-dir on another disk")


def clean_interrupted_saves(run_dir: Path) -> list[Path]:
    """Remove `step_N.tmp` directories an interrupted save left behind (never loaded)."""
    removed = []
    for tmp in sorted((run_dir / "checkpoints").glob("step_*.tmp")):
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def sequence_window(plan: Plan) -> int:
    """Tokens one training sequence reads: the sequence length + 1 (inputs and shifted targets)."""
    return (plan.training.seq_len or plan.model.seq_len) + 1


def checked_data(plan: Plan, data: str) -> str:
    """The absolute path of the token file `--data` names (a path or a bundled corpus), checked
    before any rank starts: whole tokens, at least one sequence, ids inside the model's vocabulary."""

    try:
        tokens = open_tokens(data, plan.model.vocab, sequence_window(plan))
    except SpecError as err:
        raise SpecError(f"--data {data}", err.problems) from err
    except (OSError, ValueError) as err:
        detail = os_error_message(err) if isinstance(err, OSError) else str(err)
        raise SpecError(f"--data {data}", [f"cannot read it as a token file ({detail})"]) from err
    return str(Path(tokens.filename).resolve())


def emitted_data(plan: Plan, data: str) -> str | None:
    """`emit torchrun|slurm --data`: a file or bundled name readable here is checked as launch
    checks it; one that is not (it lives on the cluster, or names $VARIABLES) is passed as written.
    Returns a note for the user in the second case."""

    if Path(data).is_file() or (BUNDLED / f"{data}.bin").is_file():
        checked_data(plan, data)
        return None
    return f"--data {data} is not on this machine: every node must be able to read it there"


def worker_argv(run_dir: Path, steps: int, backend: str, extra) -> list[str]:
    return ["--run-dir", str(run_dir), "--steps", str(steps), "--backend", backend, *map(str, extra)]


def prepare_run_dir(plan: Plan, run_dir: Path) -> Path:
    """Create the run directory, write plan.json (and plans/DIGEST.json, which keeps the plan of
    every launch of the run for plan3d/run/compare.py), clear a previous attempt's errors."""
    run_dir.mkdir(parents=True, exist_ok=True)
    check_free_space(run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    errors = run_dir / "errors"
    for stale in errors.glob("*.json") if errors.exists() else ():
        stale.unlink()
    clean_interrupted_saves(run_dir)
    plan_file, text = run_dir / PLAN, plan.model_dump_json(indent=1)
    _write_once(plan_file, text)
    if is_digest(plan.digest):
        plan_path(run_dir, plan.digest).parent.mkdir(exist_ok=True)
        _write_once(plan_path(run_dir, plan.digest), text)
    return plan_file


def _write_once(path: Path, text: str) -> None:
    """Atomic write through a private temp name: several launchers may share one run directory.
    A FIFO or device at `path` is refused, never read nor renamed over."""

    refuse_special_target(path)
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
    launcher on this machine (simulated nodes, each with its own node identity). When the port
    was ours to pick and another process took it before torchrun did, a fresh port is tried."""
    problems = runtime_problems(plan)
    if problems:
        raise LaunchError("; ".join(problems))
    local_nodes = nnodes == 1 and master_addr in LOOPBACK and nodes_needed(plan) > 1
    nnodes = nodes_needed(plan) if local_nodes else nnodes
    nproc = node_layout(plan, nnodes, node_rank)
    run_dir = Path(run_dir)
    plan_file = prepare_run_dir(plan, run_dir)
    ours = master_port is None
    if ours and nnodes > 1 and not local_nodes:
        raise LaunchError("several nodes need the same --master-port on every node")
    if not ours and (node_rank == 0 or local_nodes) and port_in_use(master_addr, master_port):
        raise LaunchError(port_in_use_message(master_addr, master_port, nnodes))
    args, timeout_s = worker_argv(run_dir, steps, backend, worker_args), timeout_from(worker_args)
    nodes = range(nnodes) if local_nodes else [node_rank]
    for _ in range(PORT_TRIES if ours else 1):
        port = free_port() if ours else master_port
        jobs = [(node, node_command(str(plan_file), nnodes, nproc, node, master_addr, port, args, worker_module,
                                    rdzv_timeout_s=timeout_s), _node_env(node, local_nodes, env)) for node in nodes]
        result = _run(jobs, run_dir, on_progress, plan.layout.world_size, _Rendezvous(master_addr, port, nnodes))
        if not (ours and result.port_taken):
            break
    return result


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def nodes_needed(plan: Plan) -> int:
    world, gpn = plan.layout.world_size, plan.gpus_per_node
    return -(-world // min(world, gpn))


def _node_env(node: int, simulated: bool, extra: dict | None) -> dict:
    """The node's identity from the scheduler (SLURM) wins on a real node; the placement check
    compares it with the rank torchrun derived from --node-rank."""
    identity = str(node) if simulated else os.environ.get("PLAN3D_NODE_RANK", str(node))
    return {**os.environ, "PLAN3D_NODE_RANK": identity, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **(extra or {})}


@dataclass
class _Rendezvous:
    """Where node 0 hosts the static rendezvous (for the messages about it)."""
    addr: str
    port: int
    nnodes: int


def _run(jobs, run_dir: Path, on_progress, world: int, rdzv: _Rendezvous) -> LaunchResult:
    """Start one torchrun per (node, argv, env); wait for all; diagnose a failure."""
    start, procs, logs = time.monotonic(), [], []
    previous = _signals_as_interrupt()
    try:
        for node, cmd, env in jobs:
            logs.append(run_dir / "logs" / f"launcher{node}.log")
            with logs[-1].open("w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True, preexec_fn=_term_with_parent))
        code = _watch(procs, run_dir, on_progress, world)
    except KeyboardInterrupt:
        for proc in procs:
            _stop(proc)
        raise
    finally:
        for proc in procs:
            _kill_group(proc)
        _restore_signals(previous)
    result = LaunchResult(code, run_dir, elapsed_s=time.monotonic() - start)
    if code != 0:
        text = "\n".join(_read_log(path) for path in logs)
        result.port_taken = port_taken(text)
        result.failed_rank, result.error = diagnose(run_dir, text, world, rdzv)
    return result


def _read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _term_with_parent() -> None:
    """In the child (Linux): SIGTERM torchrun if this launcher dies, so it stops its workers."""
    try:

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _signals_as_interrupt() -> dict | None:
    """SIGINT and SIGTERM (Ctrl-C, scheduler cancel, kill) stop the ranks. SIGINT is set
    explicitly: a launcher started in the background of a script inherits it as ignored.
    Only the main thread can set handlers (None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, _raise_interrupt) for sig in STOP_SIGNALS}


def _restore_signals(previous: dict | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def _watch(procs: list[subprocess.Popen], run_dir: Path, on_progress, world: int) -> int:
    """Poll the torchruns; forward metric records; after a failure give the others
    AFTER_ERROR_S to stop by themselves (no longer once every rank but the hung one has reported
    a timeout), then stop them. Returns the first non-zero exit."""
    metrics, seen, failed_since = run_dir / "metrics.jsonl", 0, None
    while True:
        codes = [proc.poll() for proc in procs]
        seen = _forward_metrics(metrics, seen, on_progress)
        bad = [c for c in codes if c not in (None, 0)]
        if all(c is not None for c in codes):
            return bad[0] if bad else 0
        records = read_error_records(run_dir)
        if failed_since is None and (bad or records):
            failed_since = time.monotonic()
        if _hang_reported(records, world):  # nothing left to learn; a stopped rank ignores SIGINT
            return bad[0] if bad else 1  # the caller kills every process group
        if failed_since is not None and time.monotonic() - failed_since > AFTER_ERROR_S:
            for proc in procs:
                _stop(proc)
            return bad[0] if bad else 1
        time.sleep(0.2)


def _hang_reported(records: list[dict], world: int) -> bool:
    """A timeout came first and every rank but one has reported: the diagnosis is complete."""
    return bool(records) and _is_timeout(_first(records)["error"]) and len(records) >= world - 1


def read_error_records(run_dir: Path) -> list[dict]:
    records = []
    for path in (run_dir / "errors").glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def _first(records: list[dict]) -> dict:
    return min(records, key=lambda e: e["time"])


def _is_timeout(error: str) -> bool:
    return "timed out" in error.lower() or "timeout" in error.lower()


def _forward_metrics(path: Path, seen: int, on_progress) -> int:
    if on_progress is None or not path.exists():
        return seen
    text = path.read_text()
    lines = text.splitlines()
    complete = lines if text.endswith("\n") else lines[:-1]
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


def _name_ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:RANKS_NAMED])) + (" ..." if len(ranks) > RANKS_NAMED else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def _hang_diagnosis(first: dict, records: list[dict], world: int) -> tuple[int, str]:
    """A collective timed out: the ranks that never wrote a record of their own hung (every other
    rank's collectives honour the same timeout, and the first to time out waits for their records)."""
    reported = {e["rank"] for e in records}
    hung = [rank for rank in range(world) if rank not in reported]
    if not hung or len(hung) == world:
        return first["rank"], first["error"]
    return hung[0], (f"{_name_ranks(hung)} hung (no error of its own): {len(reported)} other ranks timed out "
                     f"waiting in a collective (first rank {first['rank']}: {first['error']})")


def _killed_by_signal(launcher_log: str) -> tuple[int, str] | None:
    for rank, code in failures_from_torchrun(launcher_log):
        if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
            return rank, f"rank {rank} was killed by signal {signal.Signals(-code).name}"
    return None


def port_taken(launcher_log: str) -> bool:
    return "EADDRINUSE" in launcher_log or "address already in use" in launcher_log.lower()


def _launcher_diagnosis(run_dir: Path, launcher_log: str, rdzv: _Rendezvous | None) -> str | None:
    """What only the launcher can see: a full disk, the rendezvous port taken, a node missing."""
    free = shutil.disk_usage(run_dir).free if run_dir.exists() else MIN_FREE_BYTES
    if free < MIN_FREE_BYTES or "No space left on device" in launcher_log:
        return disk_full_message(run_dir, free)
    if rdzv is None:
        return None
    if port_taken(launcher_log):
        return port_in_use_message(rdzv.addr, rdzv.port, rdzv.nnodes)
    joined = re.search(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", launcher_log)
    if joined:
        return (f"only {joined[2]} of {joined[3]} nodes joined the rendezvous on {rdzv.addr}:{rdzv.port} within "
                f"{joined[1]} s (--timeout-s); start one launcher per node, each with its own --node-rank")
    if re.search(r"client socket has timed out .* while trying to connect", launcher_log):
        return (f"node 0 did not answer on {rdzv.addr}:{rdzv.port} within --timeout-s; start node 0's launcher "
                "(--node-rank 0) and give every node the same --master-addr and --master-port")
    return None


def diagnose(run_dir: Path, launcher_log: str, world: int | None = None,
             rdzv: _Rendezvous | None = None) -> tuple[int | None, str]:
    """(failing rank, one-line error): what only the launcher sees (disk, port, rendezvous), a hang
    (the ranks without a record), a rank killed by a signal, else the earliest error."""
    outside = _launcher_diagnosis(run_dir, launcher_log, rdzv)
    if outside:
        return None, outside
    records = read_error_records(run_dir)
    if records and world and _is_timeout(_first(records)["error"]):
        return _hang_diagnosis(_first(records), records, world)
    killed = _killed_by_signal(launcher_log)
    if killed:
        return killed
    if records:
        first = _first(records)
        return first["rank"], first["error"]
    tail = [line for line in launcher_log.splitlines() if line.strip()][-1:] or ["no output"]
    return None, f"torchrun failed: {tail[0][:300]} (see {run_dir / 'logs'})"


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise LaunchError(f"the run finished without {path}; see {Path(run_dir) / 'logs'}")
    return json.loads(path.read_text())
