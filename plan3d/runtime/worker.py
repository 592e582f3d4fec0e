"""The process torchrun starts on every rank: `python -m plan3d.runtime.worker --plan PLAN ...`.

Start-up: redirect output to `logs/rank<N>.log`, die with the launcher (PR_SET_PDEATHSIG), join
the process group with a collective timeout, check the placement against the plan, build the
mesh, the stages, ZeRO and the schedule. Each step: forward/backward, model-parallel and dp
gradient reductions, global-norm clipping, optimizer step; rank 0 appends one JSON line to
`metrics.jsonl`. Any failure writes `errors/rank<N>.json` (one line) and exits 1, so torchrun
stops the other ranks.

A collective that timed out is waited out a little longer: the rank keeps its connections open
until every other rank but one has written its own record (or `peer_grace_s` passes), so the
launcher can name the hung rank as the one without a record instead of finding every rank
stopped by torchrun before it could report.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from plan3d.errors import Plan3dError

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plan3d.runtime.worker")
    p.add_argument("--plan", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=0, help="0: save only at the end")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--data", default=None, help="token file or bundled corpus (plan3d.run.tokens); default synthetic")
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: fp32 on CPU, the plan's (bf16 mixed) on GPU")
    p.add_argument("--compile", action="store_true", help="torch.compile every transformer block")
    p.add_argument("--fail-at-step", type=int, default=0, help="testing: inject a failure")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-mode", default="kill",
                   choices=["kill", "hang", "stop", "raise", "kill-during-save", "nan"],
                   help="hang: sleep; stop: SIGSTOP itself; nan: poison the weights (next loss NaN)")
    p.add_argument("--keep-last", type=int, default=0, help="keep the newest N checkpoints (0: all)")
    return p.parse_args(argv)


def _redirect_output(run_dir: Path, rank: int) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when its launcher dies, so no orphan survives a killed torchrun."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _write_error(run_dir: Path, rank: int, err: BaseException) -> None:
    errors = run_dir / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    line = error_line(err)
    tmp = errors / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, "error": line[:500], "time": time.time()}))
    os.replace(tmp, errors / f"rank{rank}.json")


def _inject(args, rank: int, step: int) -> None:
    if args.fail_at_step != step or args.fail_rank != rank or args.fail_mode == "nan":
        return
    if args.fail_mode in ("kill", "kill-during-save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail_mode == "hang":
        time.sleep(10**6)
    if args.fail_mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise RuntimeError(f"injected failure at step {step}")


PEER_GRACE_CAP_S = 15.0
MAX_CAUSES = 8  # how deep a chain of wrapped errors is followed (a cycle cannot loop)


def _chain(err: BaseException) -> list[BaseException]:
    """The error and its causes (the pipelining schedule wraps a failed p2p in its own error)."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < MAX_CAUSES:
        chain.append(chain[-1].__cause__)
    return chain


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else ""


def error_line(err: BaseException) -> str:
    """One line: the error's first line, followed by its causes' when they say more."""
    parts = [_first_line(e) for e in _chain(err)]
    line = "; caused by ".join(dict.fromkeys(p.rstrip(":") for p in parts if p))
    return line if isinstance(err, Plan3dError) else f"{type(err).__name__}: {line}"


def is_timeout(err: BaseException) -> bool:
    """A collective or store wait that ran past --timeout-s (gloo, NCCL and the store say so)."""
    return any("timed out" in str(e).lower() or "timeout" in type(e).__name__.lower() for e in _chain(err))


def wait_for_peer_records(run_dir: Path, world: int, grace_s: float) -> None:
    """Stay (connections open) until all ranks but one have an error record, or grace_s passes."""
    errors, deadline = run_dir / "errors", time.monotonic() + grace_s
    while time.monotonic() < deadline and len(list(errors.glob("rank*.json"))) < world - 1:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_dir, rank = Path(args.run_dir), int(os.environ.get("RANK", "0"))
    _redirect_output(run_dir, rank)
    _die_with_parent()
    try:
        from plan3d.runtime.train import train

        train(args, run_dir, rank, _inject)
    except KeyboardInterrupt:  # stopped by torchrun or the launcher: not an error of this rank's own
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    except BaseException as err:  # noqa: BLE001 - one line for the launcher, full trace in the log
        traceback.print_exc()
        _write_error(run_dir, rank, err)
        sys.stdout.flush(), sys.stderr.flush()
        if is_timeout(err):
            wait_for_peer_records(run_dir, int(os.environ.get("WORLD_SIZE", "1")),
                                  min(args.timeout_s, PEER_GRACE_CAP_S))
        os._exit(1)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
