"""Plan: the versioned JSON contract between the planner and `plan3d launch`.

A plan holds the full specs (not names), the chosen Layout, the Estimate and the RankMap, so that
a launch is reproducible from one file. `digest` covers the specs and the layout, and the engine
spec the plan was made for when it has one (plans written before engines existed have none and
keep their digest).
"""
from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from plan3d import __version__
from plan3d.layout import Layout
from plan3d.rankmap import RankMap
from plan3d.specs.base import StrictModel
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.loader import read_mapping, validate
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

SCHEMA_VERSION = 1


class Plan(StrictModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    created_by: str = Field(default_factory=lambda: f"plan3d {__version__}")
    digest: str = ""
    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    layout: Layout
    engine: EngineSpec | None = Field(None, description="The engine the estimate is for (full spec).")
    estimate: dict[str, Any] = Field(default_factory=dict)
    rankmap: dict[str, Any] = Field(default_factory=dict)

    def specs_digest(self) -> str:
        return digest_of({k: getattr(self, k).model_dump(mode="json") for k in digested(self.engine)})


DIGESTED = ("cluster", "model", "training", "layout")


def digested(engine) -> tuple[str, ...]:
    """The sections the digest covers: the engine only when the plan has one."""
    return DIGESTED + (("engine",) if engine is not None else ())


def digest_of(payload: dict) -> str:
    """sha256 (16 hex digits) of the specs and layout as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def rankmap_dict(rankmap: RankMap) -> dict[str, Any]:
    """The rank map as plain JSON: order, world size, every rank's placement, every group."""
    ranks = [vars(c) for c in rankmap.all_coords()]
    return {
        "order": rankmap.order,
        "world_size": rankmap.world_size,
        "gpus_per_node": rankmap.gpus_per_node,
        "ranks": ranks,
        "groups": {name: rankmap.groups(name) for name in rankmap.group_names},
    }


def build_plan(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, layout: Layout,
               estimate: dict[str, Any] | None = None, engine: EngineSpec | None = None) -> Plan:
    from plan3d.rankmap import rankmap_for

    plan = Plan(cluster=cluster, model=model, training=training, layout=layout, engine=engine, estimate=estimate or {},
                rankmap=rankmap_dict(rankmap_for(layout, cluster.gpus_per_node)))
    plan.digest = plan.specs_digest()
    return plan


def save_plan(plan: Plan, path: Path) -> None:
    """Write atomically: a crash mid-write never leaves a truncated plan."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(plan.model_dump_json(indent=1))
        tmp.replace(path)
    except OSError as err:  # name the file the user asked for, and leave no .tmp behind
        tmp.unlink(missing_ok=True)
        raise type(err)(err.errno, err.strerror, str(path)) from err


def load_plan(path_str: str) -> Plan:
    from plan3d.errors import SpecError

    data = read_mapping(Path(path_str))
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SpecError(path_str, [f"schema_version {version!r} is not {SCHEMA_VERSION}; re-create the plan with this plan3d"])
    plan = validate(Plan, data, path_str)
    # Checked against the sections as the file holds them, not as this version's schema re-dumps
    # them: a plan written before a spec gained a defaulted field still loads.
    if plan.digest and plan.digest != digest_of({k: data.get(k) for k in digested(data.get("engine"))}):
        raise SpecError(path_str, ["digest does not match the specs and layout (edited by hand?); re-create the plan"])
    return plan
