"""What a newcomer types first: help, the catalog, error handling, start-up without torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from plan3d.cli import DEBUG_ENV, main
from plan3d.errors import SpecNotFound
from plan3d.specs import catalog
from cli_helpers import run_cli  # noqa: E402


run = run_cli


def test_help_lists_the_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("specs", "rankmap", "import-hf"):
        assert command in out


def test_specs_list_shows_the_whole_catalog(capsys):
    code, out, _ = run(capsys, "specs", "list", "--json")
    assert code == 0
    rows = json.loads(out)
    for kind in catalog.KINDS:
        assert {r["name"] for r in rows if r["kind"] == kind} == set(catalog.bundled_names(kind))
    code, table, _ = run(capsys, "specs", "list")
    assert code == 0 and "gb200-nvl72" in table and "llama3-405b" in table


def test_specs_show_model_counts_parameters(capsys):
    code, out, _ = run(capsys, "specs", "show", "llama3-8b", "--json")
    assert code == 0 and json.loads(out)["hidden"] == 4096
    code, out, _ = run(capsys, "specs", "show", "gpt3-175b")
    assert code == 0 and "parameters" in out


def test_unknown_command_and_option_exit_2(capsys):
    assert run(capsys, "recomend")[0] == 2
    assert run(capsys, "specs", "list", "--jsn")[0] == 2


def test_debug_flag_and_environment_show_the_exception(capsys, monkeypatch):
    with pytest.raises(SpecNotFound):
        main(["specs", "show", "no-such-spec", "--debug"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(SpecNotFound):
        main(["specs", "show", "no-such-spec"])
    monkeypatch.delenv(DEBUG_ENV)
    code, _, err = run(capsys, "specs", "show", "no-such-spec")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err


def test_module_entry_point_starts_without_torch():
    """`python -m plan3d` works, and planning commands never import torch (issue 2: CI without torch)."""
    script = ("import sys, runpy; sys.argv = ['plan3d', 'rankmap', '--cluster', 'dgx-h100', '--nodes', '1', "
              "'--format', 'csv']\ntry:\n    runpy.run_module('plan3d', run_name='__main__')\nexcept SystemExit:\n"
              "    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("rank,node,local_rank"), done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_help_keeps_bracketed_text_that_rich_would_read_as_markup(capsys):
    from cli_helpers import run_cli

    code, out, _ = run_cli(capsys, "estimate", "--help")
    assert code == 0 and "plan3d[plot]" in out.replace("\n", "").replace(" ", "").replace("│", "")
