"""Test tiers (`-m`): `runtime` needs torch (the bundled runtime, DeviceMesh, measuring),
`engines` needs the engines extra (tests/engines), the rest is the torch-free tier that passes
with `pip install plan3d` and the dev extra alone. `make test` runs all three.

Every test under tests/runtime/ is `runtime`; elsewhere a module says `pytestmark =
pytest.mark.runtime` or a test carries the marker. In the torch-free tier
(PLAN3D_TORCH_FREE=1, set by `make test`), a `runtime` test that was selected anyway fails
instead of skipping: the tiers must split the suite, not hide tests.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

RUNTIME_DIR = Path(__file__).parent / "runtime"
# tests/runtime imports torch at module level: without torch it is not even collected.
collect_ignore = [] if importlib.util.find_spec("torch") else ["runtime"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RUNTIME_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.runtime)


def pytest_runtest_setup(item):
    if os.environ.get("PLAN3D_TORCH_FREE") == "1" and item.get_closest_marker("runtime"):
        pytest.fail("a runtime (torch) test ran in the torch-free tier: select it with -m 'not runtime'")
