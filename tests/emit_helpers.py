"""Shared by the emitter tests: a plan on 4 DGX H100 nodes, Megatron's argument block parsed back."""
from __future__ import annotations

import shlex

import pytest

from plan3d.cli import main
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


def make_plan(model="llama3-8b", global_batch=64, precision="bf16", **layout):
    """`model`: a bundled name or a ModelSpec."""
    cluster = load_cluster("dgx-h100", nodes=4)
    return build_plan(cluster, load_model(model) if isinstance(model, str) else model, TrainingSpec(global_batch=global_batch, precision=precision),
                      Layout(**layout))

def parse_megatron(text: str) -> dict[str, str | bool]:
    """Flags to values (True for switches), from the emitted shell block."""
    body = " ".join(line for line in text.splitlines() if not line.startswith("#"))
    tokens = shlex.split(body.replace("\\", " "))
    out, i = {}, 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[tokens[i]], i = tokens[i + 1], i + 2
        else:
            out[tokens[i]], i = True, i + 1
    return out

def run_cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0
