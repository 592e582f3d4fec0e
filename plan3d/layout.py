"""Layout: the one frozen object that carries a parallel configuration everywhere.

Validated twice, at two depths: on construction for what the layout alone can say (positive
degrees, a well-formed order string), and by `layout_problems` against a model, a training spec
and a GPU count (heads divisible by tp, enough micro-batches for 1F1B, ...). Every problem is a
sentence that says what to change.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, PositiveInt, field_validator, model_validator

from plan3d.errors import LayoutError
from plan3d.specs.base import FrozenModel
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
Recompute = Literal["none", "selective", "full"]


def parse_order(order: str) -> tuple[str, ...]:
    """All five axes of an order string, first varies fastest; raise with a valid example.

    A short order names only some axes, as the recommend table prints it ('pp-dp'): each axis left
    out keeps its slot of Megatron's default tp-cp-ep-dp-pp and the named axes fill the other slots
    in the sequence given, so 'pp-dp' -> tp-cp-ep-pp-dp and 'dp-tp' -> dp-cp-ep-tp-pp. Leaving an
    axis out only places it; its size still comes from the layout.
    """
    axes = tuple(order.split("-"))
    unknown = [a for a in axes if a not in AXES]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if unknown or repeated:
        what = f"unknown axis {unknown[0]!r}" if unknown else f"repeated axis {repeated[0]!r}"
        raise LayoutError(
            f"order {order!r}: {what}; name each of tp, cp, ep, dp, pp at most once, first varies fastest "
            f"(axes left out keep their place in {DEFAULT_ORDER!r}), e.g. {DEFAULT_ORDER!r} or 'pp-dp'"
        )
    return _fill_default_slots(axes)


def _fill_default_slots(named: tuple[str, ...]) -> tuple[str, ...]:
    """Axes missing from `named` stay where DEFAULT_ORDER has them; `named` fills the rest in turn."""
    given = iter(named)
    return tuple(next(given) if axis in named else axis for axis in AXES)


def full_order(order: str) -> str:
    """The order string with all five axes ('pp-dp' -> 'tp-cp-ep-pp-dp'); raise if malformed."""
    return "-".join(parse_order(order))


def _array_as_tuple(value):
    """A JSON array is this tuple (strict validation refuses a list for a tuple); items stay strict."""
    return tuple(value) if isinstance(value, list) else value


def short_order(order: str) -> str:
    """The shortest order that `parse_order` reads back as `order`: the axes out of their default
    slot ('tp-cp-ep-pp-dp' -> 'pp-dp'); the default itself prints as 'dp-pp'."""
    moved = [axis for axis, default in zip(parse_order(order), AXES) if axis != default]
    return "-".join(moved) or "dp-pp"


class Layout(FrozenModel):
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    dp: PositiveInt = 1
    cp: PositiveInt = 1
    ep: PositiveInt = Field(1, description="Expert parallel degree, carved out of dp*cp.")
    micro_batch: PositiveInt = 1
    vpp: PositiveInt = Field(1, description="Virtual pipeline stages per pipeline rank.")
    zero: Literal[0, 1, 2, 3] = 0
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    order: str = DEFAULT_ORDER
    pp_layers: Annotated[tuple[PositiveInt, ...] | None, BeforeValidator(_array_as_tuple)] = Field(
        None, description="Layers per (virtual) stage, for uneven splits; default an even split.")

    @field_validator("order")
    @classmethod
    def _order_is_full(cls, value: str) -> str:
        return full_order(value)

    @model_validator(mode="after")
    def _self_consistent(self) -> "Layout":
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp > 1 needs pp > 1: set vpp=1 or raise pp")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1: drop it or raise tp")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp * self.vpp:
            raise ValueError(f"pp_layers needs pp*vpp = {self.pp * self.vpp} entries, got {len(self.pp_layers)}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}")
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def axes(self) -> tuple[str, ...]:
        return parse_order(self.order)

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    def stage_layers(self, layers: int) -> tuple[int, ...]:
        """Layers per virtual stage, in pipeline order (stage k*pp + r lives on pipeline rank r)."""
        if self.pp_layers is not None:
            return self.pp_layers
        chunks = self.pp * self.vpp
        assert layers % chunks == 0, "layout_problems() must reject uneven splits first"
        return (layers // chunks,) * chunks

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per pipeline per step: global / (micro_batch * dp)."""
        return global_batch // (self.micro_batch * self.dp)

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"mb{self.micro_batch}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        parts += [f"zero{self.zero}", self.recompute] + (["sp"] if self.sequence_parallel else [])
        if self.order != DEFAULT_ORDER:
            parts.append(f"order {short_order(self.order)}")
        return " ".join(parts)


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order, in O(sqrt(n)) steps (n can be a world size of millions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layout_problems(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> list[str]:
    """Every reason `layout` cannot run `model` with `training` on `world_size` GPUs."""
    problems = []
    if layout.world_size > world_size:
        problems.append(
            f"tp*pp*dp*cp = {layout.world_size} exceeds the cluster's {world_size} GPUs; "
            f"choose degrees whose product is {world_size} (or fewer GPUs), or add nodes"
        )
    kv = model.kv_heads_
    if model.heads % layout.tp or kv % layout.tp:
        valid = [t for t in divisors(kv) if model.heads % t == 0]
        problems.append(f"tp={layout.tp} does not divide {model.heads} heads / {kv} kv heads; valid tp: {_fmt(valid)}")
    if model.ffn_hidden_ % layout.tp:
        problems.append(f"tp={layout.tp} does not divide ffn_hidden={model.ffn_hidden_}")
    problems += _pipeline_problems(layout, model)
    problems += _batch_problems(layout, training)
    seq = training.seq_len or model.seq_len
    if (layout.sequence_parallel or layout.cp > 1) and seq % (layout.tp * layout.cp):
        problems.append(f"sequence length {seq} is not divisible by tp*cp={layout.tp * layout.cp} (sequence parallel)")
    return problems


def _pipeline_problems(layout: Layout, model: ModelSpec) -> list[str]:
    chunks = layout.pp * layout.vpp
    if layout.pp_layers is not None:
        if sum(layout.pp_layers) != model.layers:
            return [f"pp_layers sum to {sum(layout.pp_layers)}, the model has {model.layers} layers"]
        return []
    if chunks > model.layers:
        return [f"pp*vpp = {chunks} exceeds the model's {model.layers} layers; valid pp: {_fmt(divisors(model.layers))}"]
    if model.layers % chunks:
        valid = [p for p in divisors(model.layers) if p > 1 or layout.vpp == 1]
        return [f"pp*vpp = {chunks} does not divide {model.layers} layers; valid pp*vpp: {_fmt(valid)} (or set pp_layers)"]
    return []


def _batch_problems(layout: Layout, training: TrainingSpec) -> list[str]:
    g, dp, mb = training.global_batch, layout.dp, layout.micro_batch
    if g % dp:
        return [f"global batch {g} is not divisible by dp={dp}; valid dp: {_fmt(divisors(g))}"]
    per_replica = g // dp
    if per_replica % mb:
        return [f"micro-batch {mb} does not divide the per-replica batch {per_replica}; valid: {_fmt(divisors(per_replica))}"]
    m = per_replica // mb
    if layout.pp > 1 and m < layout.pp:
        return [f"1F1B needs at least pp={layout.pp} micro-batches, got {m} (= {g} / ({mb} * dp {dp})); "
                f"use micro-batch <= {max(1, per_replica // layout.pp)} or raise the global batch"]
    if layout.vpp > 1 and m % layout.pp:
        return [f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of pp={layout.pp}"]
    return []


def _fmt(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")


def check_layout(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> None:
    """Raise a LayoutError listing every problem, or return."""
    problems = layout_problems(layout, model, training, world_size)
    if problems:
        raise LayoutError("; ".join(problems))
