"""The flags of a run, checked once for `plan3d launch`, `emit torchrun` and `emit slurm`, and the
quoting of everything those write into a shell command or an sbatch script.

`check_run_flags` checks the flags it is given (None: not a flag of that command) and raises one
SpecError listing every bad value, so a value `launch` refuses is refused by the emitters too.
"""
from __future__ import annotations

import math
import re
import shlex

from plan3d.errors import SpecError

BACKENDS = ("auto", "gloo", "nccl")
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_CPUS_PER_TASK = 4096
_VAR = r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})"
_HOST = re.compile(rf"^(?:{_VAR}|[A-Za-z0-9][A-Za-z0-9.:_-]*)$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PARTITION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._,-]{0,127}$")
_MS = r"[0-5]?\d"
# SLURM --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds
_TIME = re.compile(rf"^(?:\d+|\d+:{_MS}|\d+:{_MS}:{_MS}|\d+-\d+|\d+-\d+:{_MS}|\d+-\d+:{_MS}:{_MS})$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _rules(steps, nnodes, node_rank, save_every, timeout_s, master_port, backend, keep_last, master_addr):
    """(flag, shown value, ok, what it must be) of every flag given."""
    ranks = max(nnodes or 1, 1)
    return [rule for rule in (
        ("steps", steps, steps is None or steps >= 1, "a positive integer"),
        ("nnodes", nnodes, nnodes is None or nnodes >= 1, "a positive integer"),
        ("node-rank", node_rank, node_rank is None or 0 <= node_rank < ranks,
         f"in 0..{ranks - 1} (0 <= rank < --nnodes)"),
        ("save-every", save_every, save_every is None or save_every >= 0, "0 (at the end only) or a positive integer"),
        ("timeout-s", timeout_s, timeout_s is None or (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S),
         f"a finite number of seconds in (0, {MAX_TIMEOUT_S:.0f}]"),
        ("master-port", master_port, master_port is None or 0 < master_port < 65536, "a port in 1..65535"),
        ("backend", repr(backend), backend is None or backend in BACKENDS, "one of " + ", ".join(BACKENDS)),
        ("keep-last", keep_last, keep_last is None or keep_last >= 0, "0 (keep every checkpoint) or a positive integer"),
        ("master-addr", repr(master_addr), master_addr is None or bool(_HOST.match(master_addr)),
         "a host name, an IP address or one $VARIABLE"),
    ) if not rule[2]]


def check_run_flags(steps: int | None = None, nnodes: int | None = None, node_rank: int | None = None,
                    save_every: int | None = None, timeout_s: float | None = None, master_port: int | None = None,
                    backend: str | None = None, keep_last: int | None = None, master_addr: str | None = None) -> None:
    """Nonsense values are bad input before anything is loaded, started or written (a dry run too)."""
    problems = [f"--{name} must be {rule}, got {value}"
                for name, value, _, rule in _rules(steps, nnodes, node_rank, save_every, timeout_s, master_port,
                                                   backend, keep_last, master_addr)]
    if problems:
        raise SpecError("command line", problems)


def check_script_flags(job_name: str | None = None, time_limit: str | None = None, partition: str | None = None,
                       cpus_per_task: int | None = None, **paths: str | None) -> None:
    """What `emit slurm` writes into #SBATCH lines, and paths written into a command (no line breaks)."""
    problems = []
    if cpus_per_task is not None and not 1 <= cpus_per_task <= MAX_CPUS_PER_TASK:
        problems.append(f"--cpus-per-task must be a positive integer (at most {MAX_CPUS_PER_TASK}), got {cpus_per_task}")
    if job_name is not None and not _JOB_NAME.match(job_name):
        problems.append(f"--job-name must be letters, digits, '.', '_' or '-' (at most 128), got {job_name!r}")
    if time_limit is not None and not _TIME.match(time_limit):
        problems.append(f"--time must be HH:MM:SS or another SLURM form (MM, MM:SS, D-HH, D-HH:MM, D-HH:MM:SS), "
                        f"got {time_limit!r}")
    if partition is not None and not _PARTITION.match(partition):
        problems.append(f"--partition must be a partition name (letters, digits, '.', '_', '-', ','), got {partition!r}")
    for flag, path in paths.items():
        if path is not None and (_CONTROL.search(path) or not path.strip()):
            problems.append(f"--{flag.replace('_', '-')} must be a path without line breaks or control characters, "
                            f"got {path!r}")
        elif path is not None and "$" in path and not _expandable(path):
            problems.append(f"--{flag.replace('_', '-')} may use $NAME or ${{NAME}} only, not other shell syntax "
                            f"($(...), backquotes, quotes), got {path!r}")
    if problems:
        raise SpecError("command line", problems)


def _expandable(word: str) -> bool:
    """Only $NAME / ${NAME} expansions, and nothing double quotes would still interpret."""
    rest = re.sub(_VAR, "", word)
    return not _CONTROL.search(word) and not any(c in rest for c in '$`"\\')


def shell_word(word: str) -> str:
    """One shell word: quoted literally, except that $NAME / ${NAME} stay expandable (inside
    double quotes, so the value is never split or globbed). Raises on anything else with a $."""
    if re.fullmatch(_VAR, word):
        return f'"{word}"'
    if "$" not in word:
        return shlex.quote(word)
    if not _expandable(word):
        raise SpecError("command line", [f"{word!r}: only $NAME or ${{NAME}} may be expanded in a written command"])
    return f'"{word}"'


def shell_line(argv) -> str:
    return " ".join(shell_word(str(a)) for a in argv)
