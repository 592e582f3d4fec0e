"""The session-wide single-process reference of the runtime tests."""
from __future__ import annotations

import pytest

from runtime_helpers import STEPS, make_plan, metrics, run


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the single-process run (tp = pp = dp = 1)."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run(make_plan(), run_dir, extra=["--no-save"])
    assert result.ok, result.error
    losses = metrics(run_dir)
    assert losses[STEPS] < losses[1], "the synthetic data must be learnable"
    return losses
