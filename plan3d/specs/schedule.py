"""Pipeline schedules as data: the table `bundled/pipeline_schedules.yaml` and its one evaluator.

Every part that depends on the schedule reads it here: the layout rules (how many model chunks a
rank runs, how many micro-batches the schedule needs), the search (which schedules an engine
runs, `EngineSpec.can_run.schedules`), the cost model (fill and drain, `bubble_weights`), the
memory model (`in_flight`, `parameter_copies`), the emitters (torch's schedule name for
torchtitan) and the runtime (which torch.distributed.pipelining class starts, where the stages
sit). The formulas and their sources are in the YAML file's header and entries.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from plan3d.specs.base import SpecModel, Text
from plan3d.specs.loader import read_mapping

TABLE = Path(__file__).resolve().parents[1] / "bundled" / "pipeline_schedules.yaml"
IN_FLIGHT_KINDS = ("one-f-one-b", "interleaved", "every-rank")


class Schedule(SpecModel):
    """One pipeline schedule (the YAML file's header defines every field)."""

    description: Text
    chunks: tuple[int, int | None] = Field(description="[min, max] model chunks (vpp) per rank; max null: any")
    placement: Literal["loop", "v"]
    bubble_weight_grads: float = Field(ge=0, le=3)
    bubble_scale: float = Field(1.0, gt=0, le=1)
    in_flight: Literal["one-f-one-b", "interleaved", "every-rank"]
    in_flight_extra: float = Field(0.0, ge=0, le=2)
    min_micro_batches_per_stage: int = Field(ge=0, le=4)
    f_b_overlap: bool
    parameter_copies: int = Field(ge=1, le=2)
    torch: str | None
    source: Text


@lru_cache(maxsize=1)
def schedules() -> dict[str, Schedule]:
    """The table, in file order (the first entry is the default without interleaving)."""
    return {name: Schedule.model_validate(entry) for name, entry in read_mapping(TABLE).items()}


def schedule_names() -> tuple[str, ...]:
    return tuple(schedules())


def default_schedule(vpp: int) -> str:
    """The schedule a layout runs when it names none: 1F1B, or interleaved 1F1B with vpp > 1
    (what Megatron-Core, DeepSpeed and plan3d's runtime pick from vpp alone)."""
    return "1f1b" if vpp == 1 else "interleaved-1f1b"


def chunk_problem(name: str, vpp: int) -> str | None:
    """Why schedule `name` cannot run `vpp` model chunks per rank, or None."""
    low, high = schedules()[name].chunks
    if vpp >= low and (high is None or vpp <= high):
        return None
    wants = f"vpp={low}" if low == high else f"vpp >= {low}" if high is None else f"vpp {low}-{high}"
    return f"the {name} schedule runs {wants} model chunks per pipeline rank, not vpp={vpp}"


def code_of(name: str) -> int:
    return schedule_names().index(name)


def default_codes(vpp: np.ndarray) -> np.ndarray:
    """The default schedule's code per row (`default_schedule` over an array of vpp)."""
    return np.where(np.asarray(vpp) > 1, code_of("interleaved-1f1b"), code_of("1f1b"))


@lru_cache(maxsize=1)
def _columns() -> dict[str, np.ndarray]:
    table = list(schedules().values())
    return {
        "min_vpp": np.array([s.chunks[0] for s in table], dtype=np.int64),
        "max_vpp": np.array([s.chunks[1] or 1 << 30 for s in table], dtype=np.int64),
        "v_shape": np.array([s.placement == "v" for s in table]),
        "bubble_weight_grads": np.array([s.bubble_weight_grads for s in table]),
        "bubble_scale": np.array([s.bubble_scale for s in table]),
        "in_flight_kind": np.array([IN_FLIGHT_KINDS.index(s.in_flight) for s in table], dtype=np.int64),
        "in_flight_extra": np.array([s.in_flight_extra for s in table]),
        "min_micro_batches_per_stage": np.array([s.min_micro_batches_per_stage for s in table], dtype=np.int64),
        "f_b_overlap": np.array([s.f_b_overlap for s in table]),
        "parameter_copies": np.array([s.parameter_copies for s in table], dtype=np.float64),
    }


def column(name: str, codes) -> np.ndarray:
    """One field of the table per row of schedule codes (scalar or array)."""
    return _columns()[name][np.asarray(codes, dtype=np.int64)]


def chunks_fit(codes, vpp) -> np.ndarray:
    """Vectorised `chunk_problem is None`."""
    vpp = np.asarray(vpp)
    return (vpp >= column("min_vpp", codes)) & (vpp <= column("max_vpp", codes))


def in_flight(codes, pp, pp_rank, vpp, m):
    """Micro-batches' activations pipeline rank `pp_rank` holds at its peak, in units of one
    micro-batch through all the rank's layers, at most the m of the step (the YAML header gives
    each kind's formula)."""
    kind = column("in_flight_kind", codes)
    plain = pp - pp_rank
    interleaved = (2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1) / vpp
    every = pp + column("in_flight_extra", codes)
    value = np.where(kind == 0, plain, np.where(kind == 1, interleaved, every))
    return np.minimum(value, m)


def zero_bubble(codes) -> np.ndarray:
    """Whether each schedule fills its bubble with deferred weight gradients (the zero-bubble
    family and DualPipe: bubble_weight_grads > 0); the one definition the engine rules, the
    search and the error bands read."""
    return column("bubble_weight_grads", codes) > 0


def bubble_weights(codes):
    """(scale, weight-gradient multiple) of the fill-and-drain formula per row."""
    return column("bubble_scale", codes), column("bubble_weight_grads", codes)


def stage_rank(stage: int, pp: int, v_shape: bool) -> int:
    """The pipeline rank that runs virtual stage `stage`: k*pp + r on rank r (loop), or stages r
    and 2*pp - 1 - r on rank r (V)."""
    if not v_shape:
        return stage % pp
    return stage if stage < pp else 2 * pp - 1 - stage


def rank_stage_ids(pp: int, vpp: int, rank: int, v_shape: bool) -> list[int]:
    """The virtual stages rank `rank` runs, in increasing order."""
    return [s for s in range(pp * vpp) if stage_rank(s, pp, v_shape) == rank]


def per_rank(values, pp: int, v_shape: bool) -> list:
    """Per-stage values (pipeline order) summed per pipeline rank."""
    out = [0] * pp
    for stage, value in enumerate(values):
        out[stage_rank(stage, pp, v_shape)] += value
    return out
