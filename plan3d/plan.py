"""Plan: the versioned JSON contract between the planner and `plan3d launch`.

A plan holds the full specs (not names), the chosen Layout, the Estimate and the RankMap, so that
a launch is reproducible from one file. `digest` covers everything the plan holds (specs, layout,
engine, estimate, rank map). `load_plan` re-validates a plan whole (issue 19): a missing digest
is refused, and a digest recomputed after an edit does not make an edit pass, because the layout
is re-checked against the plan's own cluster, model and engine, the rank map against the layout
and the estimate for finite values within physical bounds (times at most 1e9 s, bytes at most
1e18). Plans written before that carry a digest of
their specs and layout alone (and of the engine when they have one) and load after the same checks.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_serializer,
)

from plan3d import __version__
from plan3d.errors import SpecError, refuse_special_target
from plan3d.layout import Layout, job_problems
from plan3d.rankmap import MAX_PLAN_RANKS, RankMap, rankmap_for
from plan3d.specs.base import StrictModel, Text
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec, grad_dtype
from plan3d.specs.loader import (
    MAX_RUN_FILE_BYTES,
    read_mapping,
    validate,
    validation_problems,
)
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

SCHEMA_VERSION = 1
from plan3d.records import (  # noqa: E402,F401 (re-exported: the plan's record types)
    MAX_BYTES, MAX_RATE, MAX_SECONDS, Bytes, Estimate, Rate, Ratio, Seconds, _Record)


class RankMapRecord(_Record):
    """The rank map a plan carries (`rankmap_dict`): every rank's placement and every group's members."""

    model_config = ConfigDict(extra="forbid")

    order: str
    world_size: int
    gpus_per_node: int
    ranks: list[dict[str, int]]  # per global rank: its coordinates (rank, tp, pp, dp, ..., node, local)
    groups: dict[str, list[list[int]]]  # per group name: the members of each group


class Plan(StrictModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    created_by: Text = Field(default_factory=lambda: f"plan3d {__version__}")
    digest: str = ""
    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    layout: Layout
    engine: EngineSpec | None = Field(None, description="The engine the estimate is for (full spec).")
    estimate: Estimate | None = Field(None, description="The prediction (`{}` in the file: none).")
    rankmap: RankMapRecord | None = Field(None, description="Every rank's placement (`{}` in the file: none).")

    @field_validator("estimate", "rankmap", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value == {} else value

    @field_serializer("estimate", "rankmap", mode="wrap")
    def _none_is_empty(self, value, handler):
        return {} if value is None else handler(value)

    @property
    def cp_comm(self) -> str:
        """Context parallelism's K/V exchange the plan was predicted with: its engine's (RunsAs.cp_comm;
        `load_plan` fills it in for plans saved before engines stated one, `with_stated_cp_comm`), or
        all_gather, plan3d's runtime's, for a plan without an engine."""
        return self.engine.runs_as.cp_comm if self.engine is not None else "all_gather"

    @property
    def ep_dispatcher(self) -> str:
        """The MoE token dispatcher the plan was predicted with: its engine's (RunsAs.ep_dispatcher;
        alltoall for plans saved before engines stated one), or alltoall for a plan without an engine."""
        return self.engine.runs_as.ep_dispatcher if self.engine is not None else "alltoall"

    @property
    def ep_overlap(self) -> str:
        """How the plan's all-to-alls were predicted to hide: its engine's (RunsAs.ep_overlap), or none."""
        return self.engine.runs_as.ep_overlap if self.engine is not None else "none"

    @property
    def act_offload(self) -> str:
        """The activations the plan was predicted to offload to host memory: its engine's
        (RunsAs.act_offload), or none."""
        return self.engine.runs_as.act_offload if self.engine is not None else "none"

    @property
    def grad_dtype(self) -> str:
        """The gradient buffer's dtype the plan was predicted with: the training spec's choice, else
        its engine's (`plan3d.specs.engine.grad_dtype`)."""
        return grad_dtype(self.training, self.engine)

    @property
    def gpus_per_node(self) -> int:
        """Ranks per node as the plan places them (its rank map; the cluster's when it has none)."""
        return (self.rankmap or self.cluster).gpus_per_node

    def specs_digest(self) -> str:
        """The digest of everything the plan holds (specs, layout, engine, estimate, rank map)."""
        return content_digest(self.model_dump(mode="json"))


DIGESTED = ("cluster", "model", "training", "layout")  # what plans before issue 19 digested (plus engine)


def digested(engine) -> tuple[str, ...]:
    """The sections an older plan's digest covers: the engine only when the plan has one."""
    return DIGESTED + (("engine",) if engine is not None else ())


def digest_of(payload: dict) -> str:
    """sha256 (16 hex digits) of `payload` as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def content_digest(data: dict) -> str:
    """The digest of a plan: every section but the digest itself."""
    return digest_of({k: v for k, v in data.items() if k != "digest"})


def legacy_digest(data: dict) -> str:
    """The digest plans written before issue 19 carry: specs, layout and engine only."""
    return digest_of({k: data.get(k) for k in digested(data.get("engine"))})


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
               estimate: Estimate | dict[str, Any] | None = None, engine: EngineSpec | None = None) -> Plan:
    """The plan of `layout` with its rank map; `estimate`: what `plan3d.cost.estimate.estimate`
    returns (a `plan3d.records.Estimate`) or its `to_dict()`, None or {} for a plan made without one
    (the runtime's tests, calibrate)."""

    record = Estimate.unchecked(estimate) if isinstance(estimate, dict) and estimate else estimate or None
    rankmap = RankMapRecord.unchecked(rankmap_dict(rankmap_for(layout, cluster.gpus_per_node)))
    plan = Plan(cluster=cluster, model=model, training=training, layout=layout, engine=engine, estimate=record,
                rankmap=rankmap)
    plan.digest = plan.specs_digest()
    return plan


def save_plan(plan: Plan, path: Path) -> None:
    """Write atomically: a crash mid-write never leaves a truncated plan. Only a new or a regular
    file is replaced (the rename would turn /dev/full or a FIFO into a plain file): anything else
    is an OutputError, as is a special file in the way of the temp file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    refuse_special_target(path)
    refuse_special_target(tmp)
    try:
        tmp.write_text(plan.model_dump_json(indent=1))
        tmp.replace(path)
    except OSError as err:  # name the file the user asked for, and leave no .tmp behind
        tmp.unlink(missing_ok=True)
        raise type(err)(err.errno, err.strerror, str(path)) from err


RECREATE = "re-create the plan with `plan3d recommend ... --out FILE`"


def load_plan(path_str: str) -> Plan:
    """A plan file, re-validated whole: strict specs, a digest over what it holds, its layout
    against its own cluster, model and engine, its rank map against its layout, its estimate
    finite and non-negative. Any problem is a SpecError naming the file."""
    data = read_mapping(Path(path_str), MAX_RUN_FILE_BYTES)  # a plan lists every rank
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SpecError(path_str, [f"schema_version {version!r} is not {SCHEMA_VERSION}; {RECREATE}"])
    digest = data.get("digest")
    if not isinstance(digest, str) or not digest:
        raise SpecError(path_str, [f"digest: missing or empty, so the plan cannot be checked against edits; {RECREATE}"])
    plan, sections = _validate_sections(data, path_str)
    _require_plan_size(plan, path_str)
    if digest not in _accepted_digests(data, plan, sections):
        raise SpecError(path_str, [f"digest does not match what the plan holds (edited by hand?); {RECREATE}"])
    plan = with_stated_cp_comm(plan)
    problems = plan_problems(plan, sections)
    if problems:
        raise SpecError(path_str, [f"{p}; {RECREATE}" for p in problems])
    return _with_sections(plan, sections)


CP_RUN_FIELDS = ("cp_comm", "cp_gathered_kv_saved", "cp_ring_overlap")  # RunsAs fields of the K/V exchange


def with_stated_cp_comm(plan: Plan) -> Plan:
    """A plan saved before engine profiles stated context parallelism's K/V exchange, with the
    bundled profile's (what that engine ran then): its engine's defaults would say p2p where
    torchtitan and plan3d's runtime gather K/V. Plans that state it, or whose engine is not a
    bundled one, are returned unchanged."""
    engine = plan.engine
    if engine is None or "cp_comm" in engine.runs_as.model_fields_set:
        return plan
    from plan3d.specs.catalog import bundled_engine_or_none

    bundled = bundled_engine_or_none(engine.name)
    if bundled is None:
        return plan
    runs_as = engine.runs_as.model_copy(update={k: getattr(bundled.runs_as, k) for k in CP_RUN_FIELDS})
    can_run = engine.can_run.model_copy(update={"cp_comm": bundled.can_run.cp_comm})
    return plan.model_copy(update={"engine": engine.model_copy(update={"runs_as": runs_as, "can_run": can_run})})


def _require_plan_size(plan: Plan, path_str: str) -> None:
    """A plan of more ranks than `recommend --out` writes is refused before its rank map is re-derived."""

    if plan.layout.world_size > MAX_PLAN_RANKS:
        raise SpecError(path_str, [f"layout: {plan.layout.world_size:,} ranks, more than a plan may list "
                                   f"({MAX_PLAN_RANKS:,}); plan a smaller cluster"])


SECTIONS = ("estimate", "rankmap")  # checked against the rest of the plan, not by the strict schema


def _validate_sections(data: dict, path_str: str) -> tuple[Plan, dict[str, dict]]:
    """The specs and layout validated strictly, without the estimate and rank map; those are
    returned as the file holds them (strict validation reads `2.0` as the integer 2, which would
    change their digest), checked by plan_problems and typed by `_with_sections`."""
    free = {k: data[k] for k in SECTIONS if isinstance(data.get(k), dict)}
    try:
        plan = validate(Plan, {**data, **{k: {} for k in free}}, path_str)
    except SpecError as err:
        raise SpecError(path_str, [f"{p}; {RECREATE}" for p in err.problems]) from err
    return plan, free


def _with_sections(plan: Plan, sections: dict[str, dict]) -> Plan:
    """The plan with its checked estimate and rank map as typed records."""
    estimate, rankmap = sections.get("estimate"), sections.get("rankmap")
    return plan.model_copy(update={"estimate": Estimate.model_validate(estimate) if estimate else None,
                                   "rankmap": RankMapRecord.model_validate(rankmap) if rankmap else None})


def _accepted_digests(data: dict, plan: Plan, sections: dict[str, dict]) -> set[str]:
    """The digest of what the file holds, or of the plan as this version writes it back (`launch`
    re-writes plan.json into its run directory); for plans written before issue 19, the digest of
    their specs alone (their rank map and estimate are re-checked below, not trusted)."""
    as_written = plan.model_dump(mode="json") | sections
    return {content_digest(data), content_digest(as_written), legacy_digest(data), legacy_digest(as_written)}


def plan_problems(plan: Plan, sections: dict[str, dict] | None = None) -> list[str]:
    """Every reason the plan contradicts itself (each naming the section), or []. `sections`: the
    estimate and rank map as a file holds them (default: the plan's own, as it writes them)."""

    if sections is None:
        sections = plan.model_dump(mode="json", include=set(SECTIONS))

    problems = [f"layout: {p}" for p in job_problems(plan.layout, plan.model, plan.training,
                                                      plan.cluster.world_size, plan.engine)]
    if problems:  # a rank map of an impossible layout says nothing more
        return problems
    return _rankmap_problems(plan, sections.get("rankmap", {})) + _estimate_problems(sections.get("estimate", {}))


def _rankmap_problems(plan: Plan, rankmap: dict[str, Any]) -> list[str]:

    expected = json.loads(json.dumps(rankmap_dict(rankmap_for(plan.layout, plan.cluster.gpus_per_node))))
    if rankmap == expected:
        return []
    differing = sorted(k for k in set(expected) | set(rankmap) if rankmap.get(k) != expected.get(k))
    return [f"rankmap.{differing[0]}: differs from the rank map of the plan's layout on "
            f"{plan.cluster.gpus_per_node} GPUs per node"]


def _estimate_problems(estimate: dict[str, Any]) -> list[str]:
    if not estimate:  # a plan made without an estimate (the runtime's tests, calibrate)
        return []
    try:
        Estimate.model_validate(estimate, strict=True)
    except ValidationError as err:
        return validation_problems(err, prefix="estimate")
    return []
