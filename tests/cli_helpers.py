"""Running `plan3d` through its real entry point in tests."""
from __future__ import annotations

import pytest

from plan3d.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`plan3d ARGS` in process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err
