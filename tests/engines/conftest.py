"""The engines tier: every emitter's output fed to the engine's own code (`pytest -m engines`).

Engines come from the `engines` extra (`make engines`): DeepSpeed and torchtitan from the
package index, Megatron-Core's wheel unpacked into `.venv/megatron-core` where the Python in use
is older than the wheel declares (megatron-core >= 0.17 says Python >= 3.12; its argument parser
runs on 3.11 once `typing.override` exists). Without an engine its tests skip with the reason,
except when `PLAN3D_REQUIRE_ENGINES=1` (set by `make test`, so CI): then a missing engine fails
the run instead of skipping silently.
"""
from __future__ import annotations

import importlib
import os
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEGATRON_DIR = Path(os.environ.get("PLAN3D_MEGATRON_DIR", REPO / ".venv" / "megatron-core"))
REQUIRED = os.environ.get("PLAN3D_REQUIRE_ENGINES") == "1"

sys.path.insert(0, str(Path(__file__).parent))  # plans.py

if MEGATRON_DIR.is_dir() and str(MEGATRON_DIR) not in sys.path:
    sys.path.insert(0, str(MEGATRON_DIR))
if not hasattr(typing, "override"):  # Python 3.11: megatron-core 0.19 imports typing.override
    typing.override = lambda func: func  # the decorator only marks the function (PEP 698)


def require(module: str):
    """Import an engine module, or skip (fail under PLAN3D_REQUIRE_ENGINES=1) naming what is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        message = f"engine module {module} is not importable ({err}); run `make engines`"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engines)
