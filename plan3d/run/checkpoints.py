"""Checkpoint directories on disk, without torch: find, verify, keep the newest N.

A run's checkpoints live in `RUN/checkpoints/step_N/` (or `step_N-k/` when a resumed run saved
step N again); `latest` names the newest complete one. A complete checkpoint holds `meta.json`,
written last, whose `checksums` maps every shard file (`__<rank>_<i>.distcp`, `.metadata`) to
its SHA-256: a shard overwritten in place, truncated or missing is refused before any rank
loads it. Checkpoints written before checksums existed load unverified.

The launcher checks `--resume` with these functions before any rank starts; the ranks use them
to write the checksums and to apply the retention policy (`--keep-last N`).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from plan3d.errors import Plan3dError

LATEST = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)(?:-(\d+))?$")
_CHUNK = 1 << 20


class CheckpointError(Plan3dError):
    """A checkpoint that cannot be resumed from (bad input, exit 2); the message names the file
    and what to do instead."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shard_checksums(directory: Path, names) -> dict[str, str]:
    """SHA-256 of each named file of `directory` (the shards one rank wrote)."""
    return {name: file_sha256(directory / name) for name in sorted(names)}


def unlisted_files(directory: Path, listed) -> list[str]:
    """Files of a checkpoint directory no rank has claimed (meta.json excepted)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != META and p.name not in listed)


def damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint directory (one phrase naming the file), or None."""
    meta_path = directory / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return f"{meta_path} is missing or unreadable"
    for name, want in (meta.get("checksums") or {}).items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != want:
            return f"{path} does not match the checksum written when it was saved (changed or truncated)"
    return None


def step_of(directory: Path) -> tuple[int, int]:
    match = _STEP_DIR.match(directory.name)
    return (int(match[1]), int(match[2] or 0)) if match else (-1, -1)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root` (a checkpoints/ folder), oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / META).exists()]
    return sorted(found, key=step_of)


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a run/checkpoints directory whose `latest` names one."""
    for candidate in (path, path / "checkpoints"):
        if (candidate / META).exists():
            return candidate
        if (candidate / LATEST).exists():
            chosen = candidate / (candidate / LATEST).read_text().strip()
            if (chosen / META).exists():
                return chosen
    raise CheckpointError(f"no complete checkpoint under {path}: the run stopped before its first save; "
                          "start it afresh (--overwrite, or another --run-dir), or save earlier with --save-every")


def previous_good(directory: Path) -> Path | None:
    """The newest undamaged checkpoint older than `directory` in the same run."""
    older = [p for p in complete_checkpoints(directory.parent) if step_of(p) < step_of(directory)]
    for candidate in reversed(older):
        if damage(candidate) is None:
            return candidate
    return None


def verified(path: Path) -> Path:
    """The checkpoint `path` resolves to, refused with one line when a shard is damaged."""
    directory = resolve(path)
    problem = damage(directory)
    if problem is None:
        return directory
    good = previous_good(directory)
    offer = (f"; resume from the previous good one with --resume-from {good}" if good else
             "; no earlier undamaged checkpoint in this run: start afresh (--overwrite, or another --run-dir)")
    raise CheckpointError(f"checkpoint {directory} is damaged: {problem}{offer}")


def prune(root: Path, keep_last: int, protect: Path) -> list[Path]:
    """Delete the oldest complete checkpoints beyond the newest `keep_last` (0: keep all);
    `protect` (the one just written, which `latest` names) is never deleted."""
    if keep_last <= 0:
        return []
    doomed = [p for p in complete_checkpoints(root) if p != protect]
    doomed = doomed[:max(0, len(doomed) - (keep_last - 1))]
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)
    return doomed
