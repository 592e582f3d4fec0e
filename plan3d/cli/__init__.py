"""The `plan3d` command line: parse -> load -> call -> render. Nothing else lives here.

Each command family is its own module that registers on `app`; `main` is the one place that
maps errors to messages and exit codes.
"""
from __future__ import annotations

import os
import sys

import typer

from plan3d.cli.app import app
from plan3d.cli import specs_cmd  # noqa: F401  (registers commands)
from plan3d.cli import importhf_cmd  # noqa: F401
from plan3d.cli import estimate_cmd  # noqa: F401
from plan3d.cli import rankmap_cmd  # noqa: F401
from plan3d.cli import recommend_cmd  # noqa: F401
from plan3d.cli import check_cmd  # noqa: F401
from plan3d.cli import launch_cmd  # noqa: F401
from plan3d.cli import report_cmd  # noqa: F401
from plan3d.cli import calibrate_cmd  # noqa: F401
from plan3d.cli import emit_cmd  # noqa: F401
from plan3d.errors import EXIT_BAD_INPUT, EXIT_FAILED, Plan3dError, os_error_message
from plan3d.render.units import printable

DEBUG_ENV = "PLAN3D_DEBUG"


# typer's usage errors: unknown option, bad value, missing argument. typer >= 0.27.2 (which vendors
# click since 0.26) derives every one of them from the public typer.TyperException (typer PR #1942);
# Abort is apart. pyproject.toml pins typer to that range.
USAGE_ERRORS = (typer.TyperException, typer.Abort)


def main(argv: list[str] | None = None) -> None:
    def say(text: str) -> None:  # every line on stderr escaped: a path or key from a file is one line
        print(printable(text), file=sys.stderr)

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or bool(os.environ.get(DEBUG_ENV))
    args = [a for a in args if a != "--debug"]
    try:
        code = app(args=args, prog_name="plan3d", standalone_mode=False)
    except Plan3dError as err:
        if debug:
            raise
        for line in err.lines():
            say(f"error: {line}")
        sys.exit(err.exit_code)
    except USAGE_ERRORS as err:
        if err.__class__.__name__ != "NoArgsIsHelpError":  # that one has printed the help already
            say(f"error: {_usage_message(err)}")
        sys.exit(getattr(err, "exit_code", EXIT_BAD_INPUT))
    except OSError as err:  # a path the user gave: missing folder, no permission, a directory
        if debug:
            raise
        say(f"error: {os_error_message(err)}")
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # a bug: one line, the traceback on request
        if debug:
            raise
        say(f"internal error: {err.__class__.__name__}: {err} (run with --debug for the traceback; "
            "please report it)")
        sys.exit(EXIT_FAILED)
    sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


def _usage_message(err: BaseException) -> str:
    """One line: typer's own message, and where the help is (instead of a boxed usage panel)."""
    message = err.format_message() if hasattr(err, "format_message") else "aborted"
    ctx = getattr(err, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return " ".join(message.split()) + where
