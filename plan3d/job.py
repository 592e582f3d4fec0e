"""Job file: cluster + model + training (+ an optional layout), the input of `check` and `launch`.

A job composes the specs with a Layout and an engine, so it sits above plan3d.specs and
plan3d.layout (which import nothing of it).

    cluster: dgx-a100-80g        # bundled name, path (relative to this file) or inline mapping
    nodes: 64                    # optional overrides of the cluster size
    model: gpt3-175b
    training: {global_batch: 1536, precision: bf16}
    layout: {tp: 8, pp: 8, dp: 8, micro_batch: 1}
    engine: megatron-core        # optional: bundled name, path or inline mapping; default by cluster
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, PositiveInt

from plan3d.layout import Layout
from plan3d.specs.base import SpecModel
from plan3d.specs.catalog import engine_for, load_cluster, load_model, lookups, resize
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import CpComm, EngineSpec
from plan3d.specs.loader import read_mapping, validate
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec


class JobSpec(SpecModel):
    cluster: str | ClusterSpec
    nodes: PositiveInt | None = None
    gpus_per_node: PositiveInt | None = None
    model: str | ModelSpec
    training: TrainingSpec
    layout: Layout | None = None
    engine: str | EngineSpec | None = None
    cp_comm: CpComm | None = Field(None, description="Context parallelism's K/V exchange (as --cp-comm); "
                                   "default: what the engine runs.")


class Job(SpecModel):
    """A job with every name resolved (the engine: the job's, or the cluster's default)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    layout: Layout | None = None
    engine: EngineSpec


def load_job(path_str: str, engine: EngineSpec | None = None) -> Job:
    """The job file with names resolved; `engine` (e.g. `check --engine`) overrides the file's `engine:`."""
    path = Path(path_str)
    spec = validate(JobSpec, read_mapping(path), path_str, lookups())  # an inline cluster may name its GPU
    base = path.parent
    cluster = spec.cluster
    if isinstance(cluster, str):
        cluster = load_cluster(_relative(base, cluster), spec.nodes, spec.gpus_per_node)
    else:
        cluster = resize(cluster, spec.nodes, spec.gpus_per_node, path_str)
    model = load_model(_relative(base, spec.model)) if isinstance(spec.model, str) else spec.model
    if engine is None:
        engine = spec.engine if isinstance(spec.engine, EngineSpec) else \
            engine_for(spec.engine and _relative(base, spec.engine), cluster, model)
    engine = engine.with_cp_comm(spec.cp_comm)
    return Job(cluster=cluster, model=model, training=spec.training, layout=spec.layout, engine=engine)


def _relative(base: Path, name_or_path: str) -> str:
    """Paths in a job file are relative to the job file; bare names stay bundled names."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml", ".json")):
        candidate = base / name_or_path
        return str(candidate if not Path(name_or_path).is_absolute() else name_or_path)
    return name_or_path
