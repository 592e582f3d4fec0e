"""JSON Schema of every kind of file plan3d reads (`plan3d specs schema`): the specs, the layout,
the job and the plan. It sits above them all (plan3d.specs imports nothing of it)."""
from __future__ import annotations

from pydantic import BaseModel

from plan3d.job import JobSpec
from plan3d.layout import Layout
from plan3d.plan import Plan
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

KINDS: dict[str, type[BaseModel]] = {
    "cluster": ClusterSpec, "gpu": GPUSpec, "model": ModelSpec, "engine": EngineSpec, "training": TrainingSpec,
    "layout": Layout, "job": JobSpec, "plan": Plan}


def schemas() -> dict[str, dict]:
    return {name: model.model_json_schema() for name, model in KINDS.items()}
