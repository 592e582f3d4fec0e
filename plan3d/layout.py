"""Layout: the one frozen object that carries a parallel configuration everywhere.

Validated twice, at two depths: on construction for what the layout alone can say (positive
degrees, a well-formed order string), and by `layout_problems` against a model, a training spec
and a GPU count (heads divisible by tp, enough micro-batches for 1F1B, ...). Every problem is a
sentence that says what to change. Those rules are one table, `LAYOUT_RULES`, that the search
(`plan3d.search.shape_reasons`) evaluates over numpy arrays of layouts as reason codes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BeforeValidator, Field, PositiveInt, field_validator, model_validator

from plan3d.errors import LayoutError
from plan3d.specs import schedule as schedules
from plan3d.specs.base import FrozenModel
from plan3d.specs.model import ModelSpec
from plan3d.specs.order import AXES, DEFAULT_ORDER, parse_order  # noqa: F401  (re-exported)
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_MODES

Recompute = Literal[RECOMPUTE_MODES]


def full_order(order: str) -> str:
    """The order string with all five axes ('pp-dp' -> 'tp-cp-ep-pp-dp'); raise if malformed."""
    return "-".join(parse_order(order))


def active_axes(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes of `order` (first varies fastest) whose size in `sizes` exceeds 1: all that
    decides the groups, since an axis of size 1 adds no stride."""
    return tuple(axis for axis in parse_order(order) if sizes.get(axis, 1) > 1)


def same_groups(order: str, other: str, sizes: dict[str, int]) -> bool:
    """True when the two orders build the same groups for degrees `sizes`: they list the axes of
    size > 1 in the same sequence (with pp = 1, tp-cp-ep-dp-pp and tp-cp-ep-pp-dp are one placement)."""
    return active_axes(order, sizes) == active_axes(other, sizes)


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
    ep: PositiveInt = Field(1, description="Expert parallel degree, carved out of dp*cp (of tp*cp*dp / etp "
                            "with etp).")
    etp: PositiveInt | None = Field(None, description="Expert tensor-parallel degree: each expert's FFN split over "
                                    "etp ranks, ep*etp of the tp*cp*dp ranks of a stage forming the expert grid "
                                    "(MoE Parallel Folding, Megatron-Core --expert-tensor-parallel-size); "
                                    "None: tp.")
    micro_batch: PositiveInt = 1
    vpp: PositiveInt = Field(1, description="Virtual pipeline stages per pipeline rank.")
    schedule: str | None = Field(None, description="Pipeline schedule (bundled/pipeline_schedules.yaml: 1f1b, "
                                 "interleaved-1f1b, zb1p, zbv, dualpipev, dualpipe); None: 1f1b, or "
                                 "interleaved-1f1b with vpp > 1.")
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
        if self.schedule is not None:
            if self.pp == 1:
                raise ValueError(f"schedule {self.schedule} needs pp > 1: drop it or raise pp")
            problem = schedules.chunk_problem(self.schedule, self.vpp)
            if problem:
                raise ValueError(problem)
        if self.pp_layers is not None and len(self.pp_layers) != self.pp * self.vpp:
            raise ValueError(f"pp_layers needs pp*vpp = {self.pp * self.vpp} entries, got {len(self.pp_layers)}")
        if self.etp is None and (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}")
        if self.etp is not None and (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"ep*etp={self.ep * self.etp} must divide tp*cp*dp={self.tp * self.cp * self.dp}")
        return self

    @field_validator("schedule")
    @classmethod
    def _known_schedule_default_none(cls, value, info):
        """A known schedule; the default for the layout's vpp is stored as None (one name for one job)."""
        if value is None:
            return None
        names = schedules.schedule_names()
        if value not in names:
            raise ValueError(f"schedule {value!r}: choose from {', '.join(names)}")
        return None if value == schedules.default_schedule(info.data.get("vpp", 1)) else value

    @field_validator("etp")
    @classmethod
    def _etp_none_is_tp(cls, value, info):
        """etp equal to tp is the default layout (one name for one job): stored as None."""
        return None if value is not None and value == info.data.get("tp") else value

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel degree of the experts: etp, or tp when it is not set."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel ranks (the group an expert's gradients are reduced over):
        tp*cp*dp / (ep*etp), which is dp*cp/ep when etp = tp."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def axes(self) -> tuple[str, ...]:
        return parse_order(self.order)

    @property
    def degrees(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp}

    def active_order(self) -> str:
        """The order restricted to axes of size > 1 ('' when every degree is 1)."""
        return "-".join(active_axes(self.order, self.degrees))

    def same_groups_as(self, order: str) -> bool:
        """True when `order` builds the same groups as this layout's own order (`same_groups`)."""
        return same_groups(self.order, order, self.degrees)

    @property
    def pipeline_schedule(self) -> str:
        """The schedule the layout runs: its own, or the default for its vpp."""
        return self.schedule or schedules.default_schedule(self.vpp)

    @property
    def v_shape(self) -> bool:
        """Its schedule places stages r and 2 pp - 1 - r on rank r (ZBV, DualPipeV)."""
        return schedules.schedules()[self.pipeline_schedule].placement == "v"

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs virtual stage `stage` (`plan3d.specs.schedule.stage_rank`)."""
        return schedules.stage_rank(stage, self.pp, self.v_shape)

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
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None:
            parts.append(f"etp{self.etp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.schedule is not None:
            parts.append(self.schedule)
        parts += [f"zero{self.zero}", self.recompute] + (["sp"] if self.sequence_parallel else [])
        if self.order != DEFAULT_ORDER:
            parts.append(f"order {short_order(self.order)}")
        return " ".join(parts)


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order, in O(sqrt(n)) steps (n can be a world size of millions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# ---- validity: one table of rules, read as sentences here and as reason codes by the search -----
class RuleFacts:
    """What the layout rules read: one layout's knobs as Python numbers (`RuleFacts.of`), or many
    layouts' knobs as equal-length numpy arrays (`plan3d.search.shape_reasons`); the model and
    training are shared.

    Every rule's `fails` is one expression over these attributes using `&`, `|`, `%` and
    comparisons only, so the same expression judges one layout and a whole array of them. A layout
    with `pp_layers`, or a search row marked uneven (it carries `plan3d.search.balanced_split`),
    is `uneven` and is not held to the even-split rules. Left out, `world_size` is the layout's own
    GPU count and `split_sum` the layer count (the search's grid, where both hold by construction).
    """

    def __init__(self, model: ModelSpec, training: TrainingSpec, *, tp, pp, dp, micro_batch, vpp, sequence_parallel,
                 uneven, cp=1, ep=1, etp=None, schedule=None, world_size=None, split_sum=None):
        self.heads, self.kv_heads, self.ffn_hidden = model.heads, model.kv_heads_, model.ffn_hidden_
        self.etp = tp if etp is None else etp  # the experts' tensor-parallel degree
        self.expert_ffn = (model.moe.expert_ffn_hidden or model.ffn_hidden_) if model.moe is not None else 0
        self.layers, self.batch, self.seq = model.layers, training.global_batch, training.seq_len or model.seq_len
        self.tp, self.pp, self.dp, self.cp, self.ep, self.mb, self.vpp = tp, pp, dp, cp, ep, micro_batch, vpp
        self.experts = model.moe.experts if model.moe is not None else 0  # routed experts (0: a dense model)
        self.model_name = model.name
        self.sp, self.uneven = sequence_parallel, uneven
        self.even = ~uneven if isinstance(uneven, np.ndarray) else not uneven
        self.chunks = pp * vpp
        code = schedules.default_codes(vpp) if schedule is None else schedule  # schedule codes (the table's order)
        self.schedule_min_micro_batches = schedules.column("min_micro_batches_per_stage", code) * self.chunks
        self.per_replica = self.batch // dp
        self.micro_batches = self.per_replica // micro_batch
        self.gpus = tp * pp * dp * cp
        self.cp_chunks = cp * (1 + (cp > 1))  # pieces context parallelism cuts a sequence into: 2*cp, or 1
        self.world_size = self.gpus if world_size is None else world_size
        self.split_sum = self.layers if split_sum is None else split_sum

    @classmethod
    def of(cls, layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> RuleFacts:
        split = layout.pp_layers
        return cls(model, training, tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep,
                   etp=layout.etp, micro_batch=layout.micro_batch, vpp=layout.vpp, sequence_parallel=layout.sequence_parallel,
                   schedule=schedules.code_of(layout.pipeline_schedule), uneven=split is not None, world_size=world_size, split_sum=sum(split) if split else None)


@dataclass(frozen=True)
class LayoutRule:
    """One reason a layout cannot run a model and batch.

    `code`: the search's reason code (`plan3d.search.REASONS`), None for a rule its grid cannot
    break (tp*pp*dp is the GPU count, uneven splits sum to the layers); `reason`: the search's
    short text; `sentence`: the full one, with what to change. The rules of one `group` form a
    chain: a layout gets the sentence of the first that fails and none of the later ones, which
    assume the earlier hold."""

    code: int | None
    group: str
    reason: str
    fails: Callable[[RuleFacts], Any]
    sentence: Callable[[RuleFacts], str]


def _fmt(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")


def _too_many_gpus(x: RuleFacts) -> str:
    return (f"tp*pp*dp*cp = {x.gpus} exceeds the cluster's {x.world_size} GPUs; "
            f"choose degrees whose product is {x.world_size} (or fewer GPUs), or add nodes")


def _heads_not_divided(x: RuleFacts) -> str:
    valid = [t for t in divisors(x.kv_heads) if x.heads % t == 0]
    return f"tp={x.tp} does not divide {x.heads} heads / {x.kv_heads} kv heads; valid tp: {_fmt(valid)}"


def _layers_not_divided(x: RuleFacts) -> str:
    valid = [p for p in divisors(x.layers) if p > 1 or x.vpp == 1]
    return f"pp*vpp = {x.chunks} does not divide {x.layers} layers; valid pp*vpp: {_fmt(valid)} (or set pp_layers)"


def _too_few_micro_batches(x: RuleFacts) -> str:
    return (f"1F1B needs at least pp={x.pp} micro-batches, got {x.micro_batches} (= {x.batch} / ({x.mb} * dp {x.dp})); "
            f"use micro-batch <= {max(1, x.per_replica // x.pp)} or raise the global batch")


def _cp_chunks_fail(x: RuleFacts):
    return (x.cp > 1) & (x.seq % (2 * x.cp) != 0)


def _sp_tokens_fail(x: RuleFacts):
    return x.sp & (x.seq % (x.tp * x.cp_chunks) != 0)


def _cp_chunks_uneven(x: RuleFacts) -> str:
    valid = [c for c in divisors(x.seq // 2) if c > 1] if x.seq % 2 == 0 else []
    return (f"cp={x.cp} splits each sequence into 2*cp = {2 * x.cp} load-balanced chunks (Megatron-Core), but "
            f"the sequence length {x.seq} is not divisible by {2 * x.cp}; valid cp: {_fmt(valid) or 'none (odd length)'}")


def _sp_tokens_uneven(x: RuleFacts) -> str:
    split = f"tp*2*cp={x.tp * x.cp_chunks}" if x.cp > 1 else f"tp={x.tp}"
    return (f"sequence length {x.seq} is not divisible by {split} (sequence parallelism splits each rank's "
            f"tokens over tp); change tp or cp, or drop sequence parallelism")


def _ep_without_experts(x: RuleFacts) -> str:
    return f"ep={x.ep} needs a mixture-of-experts model; {x.model_name} is dense: use ep=1"


def _ep_not_dividing_experts(x: RuleFacts) -> str:
    return (f"ep={x.ep} does not divide the {x.experts} routed experts (each expert-parallel rank holds "
            f"experts / ep whole experts); valid ep: {_fmt(divisors(x.experts))}")


def _ep_not_dividing_dp_cp(x: RuleFacts) -> str:
    if x.etp != x.tp:
        ranks = x.tp * x.cp * x.dp // x.etp if (x.tp * x.cp * x.dp) % x.etp == 0 else 0
        valid = [e for e in divisors(ranks) if not x.experts or x.experts % e == 0] if ranks else []
        return (f"ep*etp = {x.ep * x.etp} must divide tp*cp*dp = {x.tp * x.cp * x.dp} (the expert grid folds "
                f"into a stage's ranks); valid ep at etp={x.etp}: {_fmt(valid) if valid else 'none'}")
    valid = [e for e in divisors(x.dp * x.cp) if not x.experts or x.experts % e == 0]
    return (f"ep={x.ep} must divide dp*cp = {x.dp * x.cp} (expert parallelism folds into the data- and "
            f"context-parallel ranks of the MoE layers); valid ep: {_fmt(valid)}")


def _etp_without_experts(x: RuleFacts) -> str:
    return f"etp={x.etp} needs a mixture-of-experts model; {x.model_name} is dense: drop etp"


def _etp_not_dividing_ffn(x: RuleFacts) -> str:
    ranks = x.tp * x.cp * x.dp
    valid = [e for e in divisors(x.expert_ffn) if ranks % (x.ep * e) == 0]
    return (f"etp={x.etp} does not divide the expert FFN width {x.expert_ffn} (each expert's FFN is split over "
            f"etp ranks); valid etp at ep={x.ep}: {_fmt(valid)}")


# Context parallelism (Megatron-Core, megatron/training/arguments.py: seq_length % (2 * cp) == 0)
# cuts each sequence into 2 * cp chunks and gives rank i chunks i and 2cp-1-i, so causal attention
# costs every rank the same; sequence parallelism then splits a rank's tokens over tp. torchtitan
# 0.3.0 (trainer.py) asks seq % (tp * 2cp) with sequence parallelism; the rule takes that, the
# stricter of the two, so one layout runs on both.
LAYOUT_RULES = (
    LayoutRule(None, "world", "more GPUs than the cluster has", lambda x: x.gpus > x.world_size, _too_many_gpus),
    LayoutRule(1, "heads", "tp does not divide the attention / KV heads",
               lambda x: (x.heads % x.tp != 0) | (x.kv_heads % x.tp != 0), _heads_not_divided),
    LayoutRule(2, "ffn", "tp does not divide the FFN hidden size", lambda x: x.ffn_hidden % x.tp != 0,
               lambda x: f"tp={x.tp} does not divide ffn_hidden={x.ffn_hidden}"),
    LayoutRule(None, "pipeline", "pp_layers do not sum to the layer count",
               lambda x: x.uneven & (x.split_sum != x.layers),
               lambda x: f"pp_layers sum to {x.split_sum}, the model has {x.layers} layers"),
    LayoutRule(3, "pipeline", "pp*vpp exceeds the layer count", lambda x: x.even & (x.chunks > x.layers),
               lambda x: f"pp*vpp = {x.chunks} exceeds the model's {x.layers} layers; "
                         f"valid pp: {_fmt(divisors(x.layers))}"),
    LayoutRule(4, "pipeline", "pp*vpp does not divide the layer count",
               lambda x: x.even & (x.layers % x.chunks != 0), _layers_not_divided),
    LayoutRule(5, "batch", "dp does not divide the global batch", lambda x: x.batch % x.dp != 0,
               lambda x: f"global batch {x.batch} is not divisible by dp={x.dp}; valid dp: {_fmt(divisors(x.batch))}"),
    LayoutRule(6, "batch", "micro-batch does not divide the per-replica batch", lambda x: x.per_replica % x.mb != 0,
               lambda x: f"micro-batch {x.mb} does not divide the per-replica batch {x.per_replica}; "
                         f"valid: {_fmt(divisors(x.per_replica))}"),
    LayoutRule(7, "batch", "fewer micro-batches than pipeline stages (1F1B)",
               lambda x: (x.pp > 1) & (x.micro_batches < x.pp), _too_few_micro_batches),
    LayoutRule(8, "batch", "interleaved 1F1B: micro-batches not a multiple of pp",
               lambda x: (x.vpp > 1) & (x.micro_batches % x.pp != 0),
               lambda x: f"interleaved 1F1B needs micro-batches ({x.micro_batches}) to be a multiple of pp={x.pp}"),
    LayoutRule(9, "sequence", "sequence length not divisible by tp (sequence parallel) or 2*cp (context parallel)",
               lambda x: _cp_chunks_fail(x) | _sp_tokens_fail(x),
               lambda x: _cp_chunks_uneven(x) if _cp_chunks_fail(x) else _sp_tokens_uneven(x)),
    # Expert parallelism (Megatron-Core: num_experts % expert_model_parallel_size == 0, and EP folds
    # out of the dp x cp ranks of the MoE layers, `Layout` refusing ep that does not divide them)
    LayoutRule(17, "experts", "ep > 1 without a mixture-of-experts model", lambda x: (x.ep > 1) & (x.experts == 0),
               _ep_without_experts),
    LayoutRule(18, "experts", "ep does not divide the routed experts",
               lambda x: (x.experts > 0) & (x.experts % x.ep != 0), _ep_not_dividing_experts),
    LayoutRule(None, "experts", "ep does not divide dp*cp", lambda x: (x.tp * x.cp * x.dp) % (x.ep * x.etp) != 0,
               _ep_not_dividing_dp_cp),
    # Expert tensor parallelism other than tp (MoE Parallel Folding; searched where the engine runs it)
    LayoutRule(None, "expert-tp", "etp without a mixture-of-experts model",
               lambda x: (x.etp != x.tp) & (x.experts == 0), _etp_without_experts),
    LayoutRule(23, "expert-tp", "etp does not divide the expert FFN",
               lambda x: (x.experts > 0) & (x.etp != x.tp) & (x.expert_ffn % x.etp != 0), _etp_not_dividing_ffn),
    # The pipeline schedule's own need of micro-batches (bundled/pipeline_schedules.yaml)
    LayoutRule(24, "batch", "fewer micro-batches than the pipeline schedule needs",
               lambda x: (x.pp > 1) & (x.micro_batches < x.schedule_min_micro_batches),
               lambda x: f"the pipeline schedule needs at least {int(x.schedule_min_micro_batches)} micro-batches "
                         f"per step, the layout has {x.micro_batches}: lower the micro-batch size or dp, or choose "
                         "another schedule"),
)
SEARCHED_RULES = tuple(rule for rule in LAYOUT_RULES if rule.code is not None)  # what the search's grid can break


def broken_rules(facts: RuleFacts) -> list[LayoutRule]:
    """The rules one layout's facts fail, in table order, the first of each chain only."""
    broken, groups = [], set()
    for rule in LAYOUT_RULES:
        if rule.group not in groups and rule.fails(facts):
            broken.append(rule)
            groups.add(rule.group)
    return broken


@dataclass(frozen=True)
class RecomputeRule:
    """A recompute mode that a model or precision rules out: `fails(model, training)`, and the
    sentence. The search drops the mode from its space (`recompute_modes`); a single layout gets
    the sentence (`layout_problems`)."""

    mode: str
    fails: Callable[[ModelSpec, TrainingSpec], bool]
    sentence: Callable[[ModelSpec, TrainingSpec], str]


RECOMPUTE_RULES = (
    RecomputeRule("moe-act", lambda m, t: m.moe is None,
                  lambda m, t: f"recompute moe-act recomputes the routed experts' activation; {m.name} is dense: "
                               "use none, selective or full"),
    # with fp8, TransformerConfig.__post_init__ (megatron-core 0.19) refuses moe_act and layernorm
    # recompute under delayed scaling only: emit megatron writes the tensorwise recipe for them
    RecomputeRule("moe", lambda m, t: m.moe is None,
                  lambda m, t: f"recompute moe recomputes the MoE layers; {m.name} is dense: use none, selective or full"),
    # TransformerConfig: "mla_up_proj in recompute_modules is only supported with multi_latent_attention"
    RecomputeRule("mla-up", lambda m, t: m.mla is None,
                  lambda m, t: f"recompute mla-up recomputes multi-head latent attention's up-projections; {m.name} "
                               f"has no MLA: use none, selective{', moe-act' if m.moe is not None else ''} or full"),
)


def recompute_problems(mode: str, model: ModelSpec, training: TrainingSpec) -> list[str]:
    """Why `mode` cannot recompute `model` trained as `training` (RECOMPUTE_RULES), if it cannot."""
    return [rule.sentence(model, training) for rule in RECOMPUTE_RULES if rule.mode == mode and rule.fails(model, training)]


def recompute_modes(modes: tuple[str, ...], model: ModelSpec, training: TrainingSpec) -> tuple[str, ...]:
    """`modes` less those RECOMPUTE_RULES rule out for this model and precision."""
    return tuple(m for m in modes if not recompute_problems(m, model, training))


def layout_problems(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> list[str]:
    """Every reason `layout` cannot run `model` with `training` on `world_size` GPUs (LAYOUT_RULES,
    RECOMPUTE_RULES)."""
    facts = RuleFacts.of(layout, model, training, world_size)
    return ([rule.sentence(facts) for rule in broken_rules(facts)]
            + recompute_problems(layout.recompute, model, training))


def job_problems(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int,
                 engine=None) -> list[str]:
    """Every reason `layout` cannot run as a job: the layout rules (`layout_problems`), then what
    `engine` (an EngineSpec, or None) cannot run (`EngineSpec.layout_problems`, its profile's
    `can_run`). The one call for the pair; `check` keeps them apart only to label its findings."""
    engine_problems = engine.job_problems(layout, model, training) if engine is not None else []
    return layout_problems(layout, model, training, world_size) + engine_problems


def problem_codes(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> list[int | None]:
    """The rule codes behind `layout_problems`, one per sentence (None: a rule the search has no code for)."""
    return ([rule.code for rule in broken_rules(RuleFacts.of(layout, model, training, world_size))]
            + [None] * len(recompute_problems(layout.recompute, model, training)))


def check_layout(layout: Layout, model: ModelSpec, training: TrainingSpec, world_size: int) -> None:
    """Raise a LayoutError listing every problem, or return."""
    problems = layout_problems(layout, model, training, world_size)
    if problems:
        raise LayoutError("; ".join(problems))
