"""The `plan3d` command line: parse -> load -> call -> render. Nothing else lives here.

Each command family is its own module that registers on `app`; `main` is the one place that
maps errors to messages and exit codes.
"""
from __future__ import annotations

import os
import sys

from plan3d.cli.app import app
from plan3d.cli import specs_cmd  # noqa: F401  (registers commands)
from plan3d.cli import rankmap_cmd  # noqa: F401
from plan3d.cli import importhf_cmd  # noqa: F401
from plan3d.cli import emit_cmd  # noqa: F401
from plan3d.cli import calibrate_cmd  # noqa: F401
from plan3d.cli import report_cmd  # noqa: F401
from plan3d.cli import recommend_cmd  # noqa: F401
from plan3d.cli import check_cmd  # noqa: F401
from plan3d.cli import estimate_cmd  # noqa: F401
from plan3d.cli import launch_cmd  # noqa: F401

DEBUG_ENV = "PLAN3D_DEBUG"


def main(argv: list[str] | None = None) -> None:
    from plan3d.errors import EXIT_FAILED, Plan3dError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or bool(os.environ.get(DEBUG_ENV))
    args = [a for a in args if a != "--debug"]
    try:
        app(args=args, prog_name="plan3d")
    except Plan3dError as err:
        if debug:
            raise
        for line in err.lines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # a bug: one line, the traceback on request
        if debug:
            raise
        print(f"internal error: {err.__class__.__name__}: {err} (run with --debug for the traceback; "
              "please report it)", file=sys.stderr)
        sys.exit(EXIT_FAILED)
