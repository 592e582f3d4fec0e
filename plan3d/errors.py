"""Error types and exit codes.

Two kinds of failure (style.md, habit 4): a `Plan3dError` is something the user can fix and
carries a message saying what to change; an `assert` marks an impossible internal state.
The CLI maps each error type to one exit code in one place (`plan3d.cli`).
"""
from __future__ import annotations

import errno
import os
import stat

EXIT_OK = 0
EXIT_FAILED = 1  # no feasible layout, check failed, a rank crashed
EXIT_BAD_INPUT = 2  # malformed spec, impossible layout, missing file


class Plan3dError(Exception):
    """Base class of every user-facing error. `str(err)` is the message shown to the user."""

    exit_code = EXIT_BAD_INPUT

    def lines(self) -> list[str]:
        return [str(self)]


class SpecError(Plan3dError):
    """A spec file or value is invalid; one line per bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def lines(self) -> list[str]:
        return [f"{self.source}: {p}" for p in self.problems]


class SpecNotFound(Plan3dError):
    """A spec name or path that resolves to nothing."""


class LayoutError(Plan3dError):
    """A layout that cannot exist for this model and cluster (tp not dividing heads, ...)."""


class OutputError(Plan3dError):
    """An output path plan3d will not write to (a device, a FIFO, a socket)."""


class InfeasibleError(Plan3dError):
    """Nothing fits, or a check failed: the input was fine, the answer is no."""

    exit_code = EXIT_FAILED


class NonFinitePrediction(Plan3dError):
    """A prediction that is not a finite, non-negative number: the inputs are not physical
    (raised by plan3d.cost.finite, and by render.units.json_text for any output)."""


class LaunchError(Plan3dError):
    """A launched job failed (a rank crashed, a placement mismatch, a timeout)."""

    exit_code = EXIT_FAILED


def os_error_message(err: OSError) -> str:
    """One line for a file the user named that cannot be read or written, saying what to change."""
    path = err.filename or "a file"
    advice = {errno.ENOENT: "no such file or folder; check the path (the folder of an output must exist)",
              errno.EACCES: "permission denied; choose a path you may read/write",
              errno.EISDIR: "is a directory; give a file name",
              errno.ENOTDIR: "a part of the path is not a directory; check the path",
              errno.ENOSPC: "no space left on the device; free space or write elsewhere",
              errno.EROFS: "read-only file system; choose a writable path"}
    return f"{path}: {advice.get(err.errno, (err.strerror or str(err)).lower())}"


def refuse_special_target(path) -> None:
    """Refuse to write (by a temp file renamed over it) to a path that exists and is no regular
    file: a rename would replace a device (/dev/full), a FIFO or a socket with a plain file.
    A directory keeps its own message (`os_error_message`, EISDIR)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there yet (or a dangling link, which the rename replaces); else the write reports it
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise OutputError(f"{path}: exists and is {special_file_kind(mode)}; plan3d writes only to a new or a "
                          "regular file, never over a special one: give another path")


def special_file_kind(mode: int) -> str:
    """'a FIFO (named pipe)', 'a device', 'a socket' ... for an `st_mode` that is no regular file."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
