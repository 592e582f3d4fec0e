"""JSON Schema of every spec kind."""
from __future__ import annotations


def schemas() -> dict[str, dict]:
    from plan3d.layout import Layout
    from plan3d.plan import Plan
    from plan3d.specs.cluster import ClusterSpec
    from plan3d.specs.engine import EngineSpec
    from plan3d.specs.gpu import GPUSpec
    from plan3d.specs.job import JobSpec
    from plan3d.specs.model import ModelSpec
    from plan3d.specs.training import TrainingSpec

    kinds = {"cluster": ClusterSpec, "gpu": GPUSpec, "model": ModelSpec, "engine": EngineSpec,
             "training": TrainingSpec, "layout": Layout, "job": JobSpec, "plan": Plan}
    return {name: model.model_json_schema() for name, model in kinds.items()}
