"""The planner half never needs torch: the torch-free tier runs in a venv without it (`make test`)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PROBE = """
import sys
from plan3d.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit_info:
    code = exit_info.code or 0
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("LEAKED", leaked[:3], file=sys.stderr)
sys.exit(code if not leaked else 99)
"""


@pytest.mark.parametrize("argv", [
    ["recommend", "-c", "dgx-a100-80g", "-m", "gpt3-175b", "--top", "2"],
    ["estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--tp", "2", "--dp", "4", "--nodes", "1"],
    ["specs", "list"],
])
def test_planner_commands_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LEAKED []" in done.stderr


@pytest.mark.skipif(os.environ.get("PLAN3D_TORCH_FREE") != "1", reason="only in the torch-free tier")
def test_the_torch_free_tier_has_no_torch():
    assert importlib.util.find_spec("torch") is None, "the torch-free venv has torch installed"
