"""The session-wide single-process references of the runtime tests (each launched once)."""
from __future__ import annotations

import pytest

from runtime_helpers import STEPS, TOKEN_DATA, llama_style, make_plan, metrics, run


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the single-process run (tp = pp = dp = 1)."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run(make_plan(), run_dir, extra=["--no-save"])
    assert result.ok, result.error
    losses = metrics(run_dir)
    assert losses[STEPS] < losses[1], "the synthetic data must be learnable"
    return losses


@pytest.fixture(scope="session")
def llama_reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the Llama-style tiny model (runtime_helpers.llama_style) in one process, trained
    on the bundled text (`--data python-docs`); the CP and the 3D equivalence tests compare with it."""
    run_dir = tmp_path_factory.mktemp("llama-reference")
    result = run(llama_style(make_plan()), run_dir, extra=["--no-save", *TOKEN_DATA])
    assert result.ok, result.error
    return metrics(run_dir)
