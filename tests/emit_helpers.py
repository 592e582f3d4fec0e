"""Shared by the emitter tests: a plan on 4 DGX H100 nodes, Megatron's argument block parsed back."""
from __future__ import annotations

import pytest

from plan3d.cli import main
from script_helpers import flags, run_script  # noqa: E402
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


def make_plan(model="llama3-8b", global_batch=64, precision="bf16", **layout):
    """`model`: a bundled name or a ModelSpec."""
    cluster = load_cluster("dgx-h100", nodes=4)
    return build_plan(cluster, load_model(model) if isinstance(model, str) else model, TrainingSpec(global_batch=global_batch, precision=precision),
                      Layout(**layout))

def parse_megatron(text: str, env: dict[str, str] | None = None) -> dict[str, str | bool]:
    """Flags to values (True for switches) that the emitted job script hands pretrain_gpt.py, by
    running it with a stub torchrun (script_helpers.run_script)."""
    run = run_script(text, env)
    assert run.returncode == 0, run.stderr
    return flags(run.program_args())


def run_cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0
