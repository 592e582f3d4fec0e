"""The search space of layouts, pruned with a recorded reason for every rejection.

A layout here is (tp, pp, dp, cp, ep, micro-batch, vpp, ZeRO stage, recompute, sequence parallel,
rank order) with tp * pp * dp * cp equal to the GPU count and ep dividing dp * cp. The space is
enumerated in two levels so that it is exhaustive yet cheap:

1. *Shapes* (tp, pp, dp, cp, ep, micro_batch, vpp, sequence_parallel): every rule of
   `plan3d.layout.LAYOUT_RULES` (the table `layout_problems` reads) depends only on these, so each
   shape is checked once, over numpy arrays, and its first failing rule is its reason.
2. *Layouts*: each valid shape times every allowed (ZeRO stage, recompute, order). A rejected
   shape counts as that many rejected layouts, under its reason.

Combinations that are not layouts at all (vpp > 1 without pp > 1, sequence parallel without
tp > 1, the construction rules of `Layout`) are not generated and not counted.
The valid layouts go to the vectorised cost model (`plan3d.cost.batch.estimate_batch`) in one call;
those that do not fit in memory with headroom, or miss the user's thresholds, are rejected by the
rules of `plan3d.fit_rules.FIT_RULES` (the ones `plan3d check` states as sentences).

A search predicts for one training engine (`plan3d.specs.engine.EngineSpec`) and proposes only
what it can run: `engine_space` narrows the Space to the engine's `can_run` (the narrowed-away
knobs are not counted), and a ZeRO stage the engine runs only without pipeline parallelism is
rejected per layout under its own reason (code 15).

Context parallelism (cp) is searched where it can pay: by default up to the degree that leaves
each rank CP_AUTO_MIN_TOKENS tokens of a sequence (seq 131,072 -> cp <= 16, Llama 3 405B's
long-context CP16, Dubey et al. 2024 section 3.3.1; seq <= 8,191 -> cp = 1 only, so short-sequence
searches are unchanged), and only for an engine whose `can_run.context_parallel` is true.
`Space.max_cp` / `min_cp` override the default bound.

Expert parallelism (ep) is searched for mixture-of-experts models on engines whose
`can_run.expert_parallel` is true: every ep dividing dp * cp up to the routed experts (the layout
rules then keep the divisors of the experts, i.e. of gcd(experts, dp * cp)); dense models keep
ep = 1. `Space.max_ep` / `min_ep` override the bound.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from plan3d.cost.bands import Band, BandArrays, band_arrays, sharded_stages
from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.cost.estimate import estimate
from plan3d.cost.memory import chunk_moe_layers
from plan3d.errors import LayoutError
from plan3d.fit_rules import FIT_RULES, FitFacts, Thresholds, fit_codes
from plan3d.layout import (
    DEFAULT_ORDER,
    SEARCHED_RULES,
    Layout,
    RuleFacts,
    divisors,
    full_order,
    recompute_modes,
    recompute_problems,
    same_groups,
)
from plan3d.specs import schedule as schedules
from plan3d.specs.cluster import MAX_NODES, ClusterSpec
from plan3d.specs.engine import COMBINED_1F1B_REFUSED_RECOMPUTE, EngineSpec, balanced_split  # noqa: F401 (balanced_split: part of this module's API)
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES, RECOMPUTE_MODES, UTILISATION

DEFAULT_ORDERS = (DEFAULT_ORDER, "tp-cp-ep-pp-dp")
DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b")  # what vpp alone selects (Space.schedules = ())
SHAPE_KNOBS = ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "vpp", "schedule", "sequence_parallel")
CP_AUTO_MIN_TOKENS = 8192  # default bound on cp: each rank keeps at least this many tokens of a sequence
LAYOUT_KNOBS = SHAPE_KNOBS + ("uneven", "zero", "recompute", "order")

# (code, short reason); code 0 is "valid". Codes 1-9, 17-18, 23 and 24 are the layout rules (LAYOUT_RULES,
# in order), 10-12 the fit rules (FIT_RULES), 13-16 and 19-22 the search's own.
REASONS = {
    **{rule.code: rule.reason for rule in SEARCHED_RULES},
    **{rule.code: rule.reason for rule in FIT_RULES},
    13: "same rank placement as an earlier order (its differing axes have size 1)",
    14: "ZeRO with dp = 1 has nothing to shard (same as ZeRO-0)",
    15: "the engine cannot run this ZeRO stage with pipeline parallelism (or with this pipeline schedule)",
    16: "the engine runs tensor parallelism only without a pipeline",
    19: "the engine needs sequence parallelism for MoE with tp > 1",
    20: ("an engine rule on experts or rank order (ep with tp or ZeRO; pp-dp order needs ep = cp; expert biases "
         "with tp; combined-1f1b: vpp with pp > 1, no full, partial or moe recompute)"),
    21: "a2a context parallelism splits heads over cp: heads / tp and kv_heads / tp must divide by cp",
    22: "partial recompute with nothing to recompute (fits without: same as none)",
}
MEMORY_CODE, MFU_CODE, MEMORY_FRACTION_CODE = (rule.code for rule in FIT_RULES)
SAME_ORDER_CODE, ZERO_DP1_CODE = 13, 14
ENGINE_ZERO_PP_CODE, ENGINE_TP_PP_CODE, ENGINE_MOE_SP_CODE, ENGINE_EP_CODE = 15, 16, 19, 20
CP_HEADS_CODE, IDLE_PARTIAL_CODE = 21, 22


@dataclass(frozen=True)
class Space:
    """What the search may choose. Each degree has [min, max] bounds (max 0: no bound)."""

    min_tp: int = 1
    max_tp: int = 0
    min_pp: int = 1
    max_pp: int = 0
    min_dp: int = 1
    max_dp: int = 0
    min_micro_batch: int = 1
    max_micro_batch: int = 8
    min_vpp: int = 1
    max_vpp: int = 8
    schedules: tuple[str, ...] = ()  # pipeline schedules searched (the engine's; () : 1F1B and interleaved 1F1B)
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    orders: tuple[str, ...] = DEFAULT_ORDERS
    uneven: bool | None = None  # give pp*vpp that do not divide the layers a balanced split; None: as the engine
    sequence_parallel_required: bool = False  # tp > 1 only with sequence parallelism (the engine's rule)
    zero_with_pp: tuple[int, ...] = (0, 1, 2, 3)  # ZeRO stages allowed with pp > 1 (the engine's rule)
    zero_with_zero_bubble: tuple[int, ...] = (0, 1, 2, 3)  # ... under a zero-bubble schedule (the engine's rule)
    tensor_parallel_with_pp: bool = True  # tp > 1 together with pp > 1 (the engine's rule)
    sequence_parallel_with_moe: bool = False  # tp > 1 only with sequence parallelism (the engine's rule for MoE models)
    expert_parallel_with_tp: bool = True  # ep > 1 together with tp > 1 (the engine's rule)
    expert_parallel_zero: tuple[int, ...] = (0, 1, 2, 3)  # ZeRO stages allowed with ep > 1 (the engine's rule)
    expert_parallel_dp_last_order: bool = True  # pp > 1 in a '-dp'-last order for any ep (else ep = cp)
    moe_bias_with_tp: bool = True  # tp > 1 for an MoE model with biases (the engine's rule)
    ep_combined_1f1b: bool = False  # the engine hides the all-to-alls as combined-1f1b (its rules apply with ep > 1)
    cp_head_split: tuple[int, int] | None = None  # (heads, kv_heads) that cp must split per tp rank (a2a CP)
    min_cp: int = 1
    max_cp: int | None = None  # None: the default bound (CP_AUTO_MIN_TOKENS per rank); 0: no bound
    min_ep: int = 1
    max_ep: int | None = None  # None: the routed experts of an MoE model (1 for a dense one); 0: no bound
    # expert tensor-parallel degrees searched besides etp = tp (MoE Parallel Folding): None, as the
    # engine and model allow (1 where the engine runs etp and the model has experts); () none
    etp: tuple[int, ...] | None = None
    etp_fixed: int | None = None  # `--etp N`: only layouts whose experts split over N ranks

    def __post_init__(self) -> None:
        full = tuple(dict.fromkeys(full_order(o) for o in self.orders))  # 'pp-dp' as the table prints it
        object.__setattr__(self, "orders", full)
        bad = [r for r in self.recompute if r not in RECOMPUTE_MODES]
        if bad or not self.recompute:
            raise LayoutError(f"recompute {bad[0] if bad else 'set'!r}: choose from {', '.join(RECOMPUTE_MODES)}")
        unknown = [s for s in self.schedules if s not in schedules.schedule_names()]
        if unknown:
            raise LayoutError(f"--schedule {unknown[0]}: choose from {', '.join(schedules.schedule_names())}")
        if not self.zero or any(z not in (0, 1, 2, 3) for z in self.zero):
            raise LayoutError(f"ZeRO stages {self.zero}: choose from 0, 1, 2, 3")
        for knob in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "vpp"):
            lo, hi = self.bounds(knob)
            hi = hi or 0
            if lo < 1 or (hi and hi < lo):
                raise LayoutError(f"--min-{knob.replace('_', '-')}={lo} / --max-{knob.replace('_', '-')}={hi}: "
                                  "bounds must be >= 1 with min <= max")

    def bounds(self, knob: str) -> tuple[int, int]:
        return getattr(self, f"min_{knob}"), getattr(self, f"max_{knob}")

    def allows(self, knob: str, values: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds(knob)
        return (values >= lo) & ((values <= hi) if hi else True)

    def cp_bound(self, seq_len: int) -> int:
        """The largest cp searched (0: no bound): `max_cp`, or by default seq // CP_AUTO_MIN_TOKENS
        (at least 1, and at least min_cp)."""
        if self.max_cp is not None:
            return self.max_cp
        return max(1, self.min_cp, seq_len // CP_AUTO_MIN_TOKENS)

    def ep_bound(self, experts: int) -> int:
        """The largest ep searched (0: no bound): `max_ep`, or by default the routed experts of an
        MoE model (`experts`; its divisors among those of dp*cp are what the layout rules keep) and
        1 for a dense one (at least min_ep)."""
        if self.max_ep is not None:
            return self.max_ep
        return max(1, self.min_ep, experts)

    @property
    def layouts_per_shape(self) -> int:
        return len(self.zero) * len(self.recompute) * len(self.orders)


# ---- level 1: shapes --------------------------------------------------------------------------
def degree_triples(world_size: int, space: Space) -> np.ndarray:
    """Every (tp, pp, dp) with tp * pp * dp == world_size inside the bounds, as a (k, 3) array."""
    rows = [(tp, pp, world_size // (tp * pp))
            for tp in divisors(world_size) for pp in divisors(world_size // tp)]
    triples = np.array(rows, dtype=np.int64).reshape(-1, 3)
    keep = space.allows("tp", triples[:, 0]) & space.allows("pp", triples[:, 1]) & space.allows("dp", triples[:, 2])
    return triples[keep]


def degree_tuples(world_size: int, space: Space, seq_len: int = 0, experts: int = 0) -> np.ndarray:
    """Every (tp, pp, dp, cp, ep) with tp * pp * dp * cp == world_size and ep dividing dp * cp
    inside the bounds, as a (k, 5) array: cp = 1 first (the rows `degree_triples` gives), then each
    larger cp allowed; within each, ep = 1 first. `experts`: the routed experts of an MoE model
    (0: dense), the default bound on ep (`Space.ep_bound`)."""
    hi = space.cp_bound(seq_len)
    cps = [c for c in divisors(world_size) if c >= space.min_cp and (not hi or c <= hi)]
    parts = [_with_cp(degree_triples(world_size // cp, space), cp) for cp in cps]
    tuples = np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)
    return _with_ep(tuples, space, experts)


def _with_ep(tuples: np.ndarray, space: Space, experts: int) -> np.ndarray:
    """Each (tp, pp, dp, cp) row once per expert-parallel degree ep in the bounds and expert
    tensor-parallel degree etp: etp = tp with ep dividing dp * cp, then each other etp of
    `space.etp` (MoE Parallel Folding, Megatron-Core) with ep > 1 and ep * etp dividing
    tp * cp * dp, a stage's ranks (so ep may exceed dp * cp: ETP1 EP64 at TP2). A (k, 6) array."""
    hi = space.ep_bound(experts)
    world = int(np.prod(tuples[0])) if len(tuples) else 1
    eps = np.array([e for e in divisors(world) if e >= space.min_ep and (not hi or e <= hi)] or [0], dtype=np.int64)
    row, ep = (a.ravel() for a in np.meshgrid(np.arange(len(tuples)), eps, indexing="ij"))
    tp, stage = tuples[row, 0], tuples[row, 0] * tuples[row, 2] * tuples[row, 3]
    keep = (ep > 0) & ((tuples[row, 2] * tuples[row, 3]) % np.maximum(ep, 1) == 0)
    parts = [np.column_stack([tuples[row[keep]], ep[keep], tp[keep]])]
    for etp in space.etp or ():
        folded = (ep > 1) & (tp != etp) & (stage % np.maximum(ep * etp, 1) == 0)
        parts.append(np.column_stack([tuples[row[folded]], ep[folded], np.full(int(folded.sum()), etp)]))
    return np.concatenate(parts)


def require_some_ep(space: Space, model: ModelSpec, world_size: int) -> None:
    """A fixed or bounded ep > 1 of an MoE model that no degree can meet (ep must divide the routed
    experts and the GPU count) is a LayoutError naming the values that can, not an empty search."""
    if model.moe is None or space.min_ep == 1:
        return
    hi = space.ep_bound(model.moe.experts)
    fits = [e for e in divisors(model.moe.experts) if world_size % e == 0]
    if not any(space.min_ep <= e and (not hi or e <= hi) for e in fits):
        raise LayoutError(f"ep {space.min_ep}..{hi or 'any'}: ep must divide the model's {model.moe.experts} "
                          f"experts and the {world_size} GPUs; possible ep: {', '.join(map(str, fits))}")


def _with_cp(triples: np.ndarray, cp: int) -> np.ndarray:
    return np.column_stack([triples, np.full(len(triples), cp, dtype=np.int64)])


def shape_grid(world_size: int, space: Space, layers: int = 0, seq_len: int = 0,
               experts: int = 0) -> dict[str, np.ndarray]:
    """Every well-formed shape as equal-length arrays keyed by SHAPE_KNOBS (refused with a
    SearchBudgetError when there would be more than MAX_SHAPES). `seq_len` sets the default cp
    bound (`Space.cp_bound`); 0: cp = 1 unless the space bounds it. `experts` the default ep
    bound (`Space.ep_bound`); 0: ep = 1 unless the space bounds it."""
    tuples = degree_tuples(world_size, space, seq_len, experts)
    sps = np.array(sorted(set(space.sequence_parallel)), dtype=bool)
    require_shape_budget(len(tuples), space, len(sps), world_size, layers)
    mbs = np.arange(space.min_micro_batch, space.max_micro_batch + 1, dtype=np.int64)
    vpps = np.arange(space.min_vpp, space.max_vpp + 1, dtype=np.int64)
    t, m, v, s = (a.ravel() for a in np.meshgrid(np.arange(len(tuples)), mbs, vpps, sps, indexing="ij"))
    grid = {"tp": tuples[t, 0], "pp": tuples[t, 1], "dp": tuples[t, 2], "cp": tuples[t, 3], "ep": tuples[t, 4],
            "etp": tuples[t, 5], "micro_batch": m, "vpp": v, "sequence_parallel": s, "uneven": np.zeros(len(t), dtype=bool)}
    well_formed = ((grid["vpp"] == 1) | (grid["pp"] > 1)) & (~grid["sequence_parallel"] | (grid["tp"] > 1))
    if space.sequence_parallel_required:
        well_formed &= grid["sequence_parallel"] | (grid["tp"] == 1)
    return with_schedules({k: a[well_formed] for k, a in grid.items()}, space.schedules)


def with_schedules(grid: dict[str, np.ndarray], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each shape once per schedule of `names` that runs its vpp (`plan3d.specs.schedule`), as
    schedule codes; a shape without a pipeline once, as 1F1B. () : the default schedule of each
    vpp (1F1B, interleaved 1F1B), so an engine with only those adds no rows."""
    vpp, piped = grid["vpp"], grid["pp"] > 1
    if not names:
        return dict(grid, schedule=schedules.default_codes(vpp))
    parts = []
    for code in (schedules.code_of(n) for n in names):
        rows = np.where(piped, schedules.chunks_fit(code, vpp), code == schedules.code_of("1f1b"))
        parts.append(({k: a[rows] for k, a in grid.items()}, code))
    out = {k: np.concatenate([p[k] for p, _ in parts]) for k in grid}
    out["schedule"] = np.concatenate([np.full(len(p["tp"]), code, dtype=np.int64) for p, code in parts])
    return out


# ---- the budget: a search takes seconds, never minutes (issue 19) -----------------------------
MAX_SHAPES = 2_000_000  # shapes held as numpy arrays at once (about 0.1 GB, well under a second)
# rank-map work: ranks placed, summed over the distinct (tp, pp, dp, order) placements evaluated;
# about 0.4-0.5 us of CPU per rank (dgx-h100, 131,072 and 1,048,576 GPUs), so about 4 s at most
MAX_PLACED_RANKS = 10_000_000


class SearchBudgetError(LayoutError):
    """The space is too large to search in seconds; the message says how to narrow it."""


def require_shape_budget(triples: int, space: Space, sps: int, world_size: int, layers: int = 0) -> None:
    """Refuse a grid of more than MAX_SHAPES shapes before it is built (`triples`: the
    (tp, pp, dp, cp) splits)."""
    mbs = space.max_micro_batch - space.min_micro_batch + 1
    vpps = space.max_vpp - space.min_vpp + 1
    shapes = triples * mbs * vpps * sps
    if shapes <= MAX_SHAPES:
        return
    hints = []
    if mbs > 64:
        hints.append(f"--max-micro-batch (now {space.max_micro_batch})")
    if vpps > 64 or (layers and space.max_vpp > layers):
        hints.append(f"--max-vpp (now {space.max_vpp}; at most the {layers} layers can be useful)" if layers
                     else f"--max-vpp (now {space.max_vpp})")
    hints += ["--tp/--pp/--dp/--cp/--ep or their --min/--max bounds", "fewer --nodes"]
    raise SearchBudgetError(f"the search space of {world_size:,} GPUs holds {shapes:,} shapes ({triples:,} tp/pp/dp/cp/ep "
                            f"splits x {mbs:,} micro-batch sizes x {vpps:,} vpp values x {sps} sequence-parallel "
                            f"settings), more than the {MAX_SHAPES:,} searched at once; narrow it with "
                            + ", ".join(hints))


def placed_ranks(layouts: dict[str, np.ndarray], world_size: int) -> tuple[int, int]:
    """(distinct rank placements among `layouts`, ranks the rank maps of them place in all)."""
    if not len(layouts["tp"]):
        return 0, 0
    key = np.zeros(len(layouts["tp"]), dtype=np.int64)  # dp follows from tp, pp, cp
    for k in ("tp", "pp", "order") + tuple(k for k in ("cp", "ep") if k in layouts):  # mixed-radix code: a 1-D unique is far faster than unique(axis=0)
        key = key * (int(layouts[k].max()) + 1) + layouts[k]
    placements = len(np.unique(key))
    return placements, placements * world_size


def require_within_budget(layouts: dict[str, np.ndarray], cluster: ClusterSpec) -> None:
    """Refuse a search whose rank maps would place more than MAX_PLACED_RANKS ranks."""
    placements, ranks = placed_ranks(layouts, cluster.world_size)
    if ranks <= MAX_PLACED_RANKS:
        return
    raise SearchBudgetError(f"{cluster.world_size:,} GPUs: {len(layouts['tp']):,} valid layouts in {placements:,} "
                            f"rank placements would place {ranks:,} ranks (the budget is {MAX_PLACED_RANKS:,}, a "
                            "few seconds); narrow it: fix --tp and --pp (or bound them with --min/--max), "
                            "allow one --order, or search fewer --nodes")


def shape_reasons(grid: dict[str, np.ndarray], model: ModelSpec, training: TrainingSpec) -> np.ndarray:
    """First failing rule per shape (0: valid): `plan3d.layout.LAYOUT_RULES`, the table behind
    `layout_problems`, evaluated over the grid's arrays.

    A shape marked `uneven` carries `balanced_split` as pp_layers, so the even-split rules skip it."""
    uneven = grid.get("uneven")
    facts = RuleFacts(model, training, tp=grid["tp"], pp=grid["pp"], dp=grid["dp"], cp=grid.get("cp", 1),
                      ep=grid.get("ep", 1), etp=grid.get("etp"),
                      micro_batch=grid["micro_batch"], schedule=grid.get("schedule"),
                      vpp=grid["vpp"], sequence_parallel=grid["sequence_parallel"],
                      uneven=np.zeros(len(grid["tp"]), dtype=bool) if uneven is None else uneven)
    codes = np.zeros(len(grid["tp"]), dtype=np.int8)
    for rule in SEARCHED_RULES:
        codes[(codes == 0) & rule.fails(facts)] = rule.code
    return codes


def allow_uneven(shapes: dict[str, np.ndarray], codes: np.ndarray, model: ModelSpec,
                 training: TrainingSpec) -> np.ndarray:
    """Mark shapes rejected only for an uneven split as uneven, and re-judge them (codes updated)."""
    uneven = codes == UNEVEN_CODE
    shapes["uneven"] = uneven
    codes = codes.copy()
    codes[uneven] = shape_reasons({k: a[uneven] for k, a in shapes.items()}, model, training)
    return codes


# ---- level 2: layouts ------------------------------------------------------------------------
def expand_layouts(shapes: dict[str, np.ndarray], space: Space) -> dict[str, np.ndarray]:
    """Each shape times every allowed (zero, recompute index, order index); shape-major order."""
    n, per = len(shapes["tp"]), space.layouts_per_shape
    z, r, o = (a.ravel() for a in np.meshgrid(
        np.array(space.zero, dtype=np.int64),
        np.array([RECOMPUTE_CODES[x] for x in space.recompute], dtype=np.int64),
        np.arange(len(space.orders), dtype=np.int64), indexing="ij"))
    out = {k: np.repeat(a, per) for k, a in shapes.items()}
    out.update(zero=np.tile(z, n), recompute=np.tile(r, n), order=np.tile(o, n))
    return out


def same_placement(layouts: dict[str, np.ndarray], orders: tuple[str, ...]) -> np.ndarray:
    """True where an earlier order of `orders` places every rank the same way for this shape
    (`plan3d.layout.same_groups`, the rule the emitters apply too), looked up per row in a table
    over which of tp, pp, dp, cp, ep exceed 1."""
    axes = ("tp", "pp", "dp", "cp", "ep")
    table = np.zeros((2 ** len(axes), len(orders)), dtype=bool)  # [which of the axes exceed 1, order]
    for pattern in range(2 ** len(axes)):
        sizes = {axis: 2 if pattern >> bit & 1 else 1 for bit, axis in enumerate(axes)}
        for i, order in enumerate(orders):
            table[pattern, i] = any(same_groups(order, earlier, sizes) for earlier in orders[:i])
    pattern = sum((layouts[axis] > 1) * 2**bit for bit, axis in enumerate(axes) if axis in layouts)
    return table[pattern, layouts["order"]]


def layout_at(layouts: dict[str, np.ndarray], orders: tuple[str, ...], i: int, layers: int = 0) -> Layout:
    """The Layout of row i (recompute, order and an uneven split of `layers` decoded)."""
    pp, vpp = int(layouts["pp"][i]), int(layouts["vpp"][i])
    split = balanced_split(layers, pp * vpp) if layouts.get("uneven", np.zeros(i + 1, bool))[i] else None
    schedule = schedules.schedule_names()[int(layouts["schedule"][i])] if "schedule" in layouts and pp > 1 else None
    cp = int(layouts["cp"][i]) if "cp" in layouts else 1
    ep = int(layouts["ep"][i]) if "ep" in layouts else 1
    etp = int(layouts["etp"][i]) if "etp" in layouts else None
    return Layout(tp=int(layouts["tp"][i]), pp=pp, dp=int(layouts["dp"][i]), cp=cp, ep=ep, etp=etp, pp_layers=split,
                  micro_batch=int(layouts["micro_batch"][i]), vpp=int(layouts["vpp"][i]), schedule=schedule,
                  zero=int(layouts["zero"][i]), recompute=RECOMPUTE_MODES[int(layouts["recompute"][i])],
                  sequence_parallel=bool(layouts["sequence_parallel"][i]),
                  order=orders[int(layouts["order"][i])])


def is_uneven(layout: Layout) -> bool:
    return layout.pp_layers is not None and len(set(layout.pp_layers)) > 1


def layout_row(layout: Layout, orders: tuple[str, ...]) -> dict[str, int | bool]:
    """The inverse of `layout_at` for one Layout (its order must be in `orders`)."""
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep,
            "etp": layout.expert_tp, "micro_batch": layout.micro_batch,
            "vpp": layout.vpp, "schedule": schedules.code_of(layout.pipeline_schedule),
            "sequence_parallel": layout.sequence_parallel, "uneven": is_uneven(layout),
            "zero": layout.zero,
            "recompute": RECOMPUTE_CODES[layout.recompute], "order": orders.index(layout.order)}


def drop_duplicates(layouts: dict[str, np.ndarray], space: Space, rejected: dict[int, int]) -> dict[str, np.ndarray]:
    """Remove layouts that are another one under a second name, and those the engine does not run
    with pipeline parallelism (their ZeRO stage, or tensor parallelism), counting them in `rejected`."""
    same_order = same_placement(layouts, space.orders)
    shards = layouts["dp"] * layouts["cp"] if "cp" in layouts else layouts["dp"]  # ZeRO shards over dp x cp
    zero_dp1 = ~same_order & (layouts["zero"] > 0) & (shards == 1) & (0 in space.zero)
    zero_bubble = (schedules.zero_bubble(layouts["schedule"]) if "schedule" in layouts
                   else np.zeros(len(layouts["tp"]), dtype=bool))
    zero_pp = ~(same_order | zero_dp1) & (layouts["pp"] > 1) & (
        ~np.isin(layouts["zero"], space.zero_with_pp) | (zero_bubble & ~np.isin(layouts["zero"], space.zero_with_zero_bubble)))
    rejected[SAME_ORDER_CODE] = int(same_order.sum())
    rejected[ZERO_DP1_CODE] = int(zero_dp1.sum())
    tp_pp = (~(same_order | zero_dp1 | zero_pp) & (not space.tensor_parallel_with_pp)
             & (layouts["tp"] > 1) & (layouts["pp"] > 1))
    rejected[ENGINE_ZERO_PP_CODE] = int(zero_pp.sum())
    rejected[ENGINE_TP_PP_CODE] = int(tp_pp.sum())
    dropped = same_order | zero_dp1 | zero_pp | tp_pp
    if space.sequence_parallel_with_moe:
        moe_sp = ~dropped & (layouts["tp"] > 1) & ~layouts["sequence_parallel"].astype(bool)
        rejected[ENGINE_MOE_SP_CODE] = int(moe_sp.sum())
        dropped = dropped | moe_sp
    ep_rule = ~dropped & engine_ep_refuses(layouts, space)
    rejected[ENGINE_EP_CODE] = int(ep_rule.sum())
    dropped = dropped | ep_rule
    if space.cp_head_split is not None and "cp" in layouts:
        heads_rule = ~dropped & cp_heads_refuse(layouts, *space.cp_head_split)
        rejected[CP_HEADS_CODE] = int(heads_rule.sum())
        dropped = dropped | heads_rule
    keep = ~dropped
    return {k: a[keep] for k, a in layouts.items()}


def engine_ep_refuses(layouts: dict[str, np.ndarray], space: Space) -> np.ndarray:
    """The layouts the engine's expert rules refuse (`EngineSpec._expert_parallel_problems` and the
    expert-bias rule, vectorised): with ep > 1, tp > 1 where it keeps experts whole and a ZeRO stage
    it does not run with ep; at any ep, Megatron-Core's '-dp'-last order with pp > 1 unless ep = cp;
    tp > 1 for an MoE model with biases where the engine has no expert tp for them; under the
    combined-1f1b overlap, pp > 1 without a virtual pipeline and the recompute modes it refuses."""
    ones = np.ones(len(layouts["tp"]), dtype=int)
    ep, cp = layouts.get("ep", ones), layouts.get("cp", ones)
    etp = layouts.get("etp", layouts["tp"])
    dp_last = np.array([o.endswith("-dp") for o in space.orders])[layouts["order"]]
    tp_rule = (layouts["tp"] > 1) & (not space.expert_parallel_with_tp)
    zero_rule = ~np.isin(layouts["zero"], space.expert_parallel_zero)
    expert_dp = layouts["tp"] * cp * layouts["dp"] // np.maximum(ep * etp, 1)
    folding = np.where(etp == layouts["tp"], ep != cp, expert_dp != layouts["dp"])  # EngineSpec: needs ep = cp, or edp = dp
    order_rule = dp_last & (layouts["pp"] > 1) & folding & (not space.expert_parallel_dp_last_order)
    bias_rule = (layouts["tp"] > 1) & (not space.moe_bias_with_tp)
    refused = [RECOMPUTE_CODES[r] for r in COMBINED_1F1B_REFUSED_RECOMPUTE]
    combined_rule = space.ep_combined_1f1b & (((layouts["pp"] > 1) & (layouts["vpp"] == 1))
                                              | np.isin(layouts["recompute"], refused))
    return ((ep > 1) & (tp_rule | zero_rule | combined_rule)) | order_rule | bias_rule


def cp_heads_refuse(layouts: dict[str, np.ndarray], heads: int, kv_heads: int) -> np.ndarray:
    """The layouts a2a context parallelism cannot split: cp > 1 where the heads or KV heads of a
    tp rank do not divide by cp (`EngineSpec.cp_comm_problems`, vectorised)."""
    tp, cp = layouts["tp"], layouts["cp"]
    return (cp > 1) & (((heads // tp) % cp != 0) | ((kv_heads // tp) % cp != 0))


def expert_tp_choices(space: Space, model: ModelSpec, engine: EngineSpec | None) -> tuple[int, ...]:
    """The expert tensor-parallel degrees searched besides etp = tp: by default ETP1 (Megatron-Core's
    MoE recipes fold TP > 1 attention with ETP1 experts) where the engine runs etp and the model has
    experts; `--etp N` that; a LayoutError where it cannot be."""
    runs = model.moe is not None and (engine is None or engine.can_run.expert_tensor_parallel)
    if space.etp_fixed is not None:
        if not runs:
            why = f"{model.name} is dense" if model.moe is None else f"{engine.name} splits experts over tp only"
            raise LayoutError(f"--etp {space.etp_fixed}: {why}; drop --etp")
        return (space.etp_fixed,)
    if space.etp is None:
        return (1,) if runs and engine is not None else ()
    return space.etp if runs else ()


def model_recompute_space(space: Space, model: ModelSpec, training: TrainingSpec) -> Space:
    """`space` without the recompute modes this model and precision rule out (RECOMPUTE_RULES); a
    LayoutError with the rule's sentence if none is left."""
    modes = recompute_modes(space.recompute, model, training)
    if not modes:
        raise LayoutError("; ".join(recompute_problems(space.recompute[0], model, training)))
    return replace(space, recompute=modes)


# ---- the engine: only what it can run ----------------------------------------------------------
def engine_space(space: Space, engine: EngineSpec) -> Space:
    """`space` narrowed to what `engine` can run; a knob the user fixed to something the engine
    cannot run is a LayoutError naming the engine and what it runs."""
    can, name = engine.can_run, engine.name
    zero = tuple(z for z in space.zero if z in set(can.zero) | set(can.zero_with_pp))
    runs = (f"ZeRO {_stages(can.zero)}" if can.zero == can.zero_with_pp else
            f"ZeRO {_stages(can.zero)} without pipeline parallelism and {_stages(can.zero_with_pp)} with it")
    _require(zero, f"{name} cannot run ZeRO-{_stages(space.zero)}; it runs {runs}")
    if space.min_pp > 1 and not set(zero) & set(can.zero_with_pp):
        raise LayoutError(f"{name} cannot run ZeRO-{_stages(zero)} with pipeline parallelism (pp >= {space.min_pp}); "
                          f"with pp > 1 it runs ZeRO {_stages(can.zero_with_pp)}")
    recompute = tuple(r for r in space.recompute if r in can.recompute)
    _require(recompute, f"{name} has no {' or '.join(space.recompute)} recompute; it runs {', '.join(can.recompute)}")
    offloadable = tuple(r for r in recompute if not engine.offload_problems(r))  # the offload's rule, per mode
    _require(offloadable, "; ".join(engine.offload_problems(recompute[0])))
    recompute = offloadable
    orders = tuple(o for o in space.orders if o in can.orders)
    if not orders and space.orders == DEFAULT_ORDERS:
        orders = tuple(can.orders)
    _require(orders, f"{name} places ranks only as {' or '.join(can.orders)}, not {' or '.join(space.orders)}")
    sp = tuple(s for s in space.sequence_parallel if can.sequence_parallel or not s)
    _require(sp, f"{name} has no sequence parallelism: drop --sequence-parallel")
    if can.sequence_parallel_required and sp == (False,) and space.min_tp > 1:
        raise LayoutError(f"{name} always shards norms over the sequence with tp > 1: drop --no-sequence-parallel")
    bounds = {}
    for knob, allowed, what in (("tp", can.tensor_parallel, "tensor parallelism: tp 1 only"),
                                ("pp", can.pipeline_parallel, "pipeline parallelism: pp 1 only"),
                                ("vpp", can.max_chunks != 1, "interleaved or multi-chunk pipeline schedule: vpp 1 only")):
        if not allowed:
            _require(space.bounds(knob)[0] == 1, f"{name} has no {what}")
            bounds[f"max_{knob}"] = 1
    if not can.context_parallel:
        _require(space.min_cp == 1, f"{name} has no context parallelism: cp 1 only (drop --cp / --min-cp)")
        bounds["max_cp"] = 1
    if not can.expert_parallel:
        _require(space.min_ep == 1, f"{name} has no expert parallelism: ep 1 only (drop --ep / --min-ep)")
        bounds["max_ep"] = 1
    if space.uneven and can.uneven_pipeline == "none":
        raise LayoutError(f"--uneven: {name} splits layers evenly over pipeline stages only; drop --uneven")
    # uneven splits by default wherever the engine runs them (issue 29): an engine that takes
    # per-stage counts gets balanced_split, which emit writes; one that splits unevenly on its own
    # (Megatron-DeepSpeed) is always searched so (balanced_split gives the same lighter-ends split
    # as its partition for BLOOM's 70 layers on 12 or 24 stages); `--even` keeps the others even
    uneven = can.uneven_pipeline == "embedding-as-layer" or (
        can.uneven_pipeline != "none" if space.uneven is None else space.uneven)
    names = tuple(s for s in space.schedules or can.schedules if s in can.schedules)
    _require(names, f"{name} has no {' or '.join(space.schedules)} pipeline schedule; it runs {', '.join(can.schedules)}")
    return replace(space, zero=zero, recompute=recompute, orders=orders, sequence_parallel=sp, uneven=uneven,
                   schedules=() if not space.schedules and set(names) <= set(DEFAULT_SCHEDULES) else names,
                   sequence_parallel_required=space.sequence_parallel_required or can.sequence_parallel_required,
                   zero_with_pp=tuple(z for z in space.zero_with_pp if z in can.zero_with_pp),
                   zero_with_zero_bubble=tuple(z for z in space.zero_with_zero_bubble if z in can.zero_with_zero_bubble),
                   tensor_parallel_with_pp=space.tensor_parallel_with_pp and can.tensor_parallel_with_pp,
                   sequence_parallel_with_moe=space.sequence_parallel_with_moe or can.sequence_parallel_with_moe,
                   expert_parallel_with_tp=space.expert_parallel_with_tp and can.expert_parallel_with_tp,
                   expert_parallel_zero=tuple(z for z in space.expert_parallel_zero if z in can.expert_parallel_zero),
                   expert_parallel_dp_last_order=space.expert_parallel_dp_last_order and can.expert_parallel_dp_last_order,
                   moe_bias_with_tp=space.moe_bias_with_tp and can.moe_bias_with_tp,
                   ep_combined_1f1b=engine.runs_as.combined_1f1b,
                   **bounds)


def _require(ok, message: str) -> None:
    if not ok:
        raise LayoutError(message)


def _stages(stages) -> str:
    return "/".join(map(str, stages)) if stages else "none"


# ---- the search ------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """Every valid layout of one cluster size with its predicted metrics, and the rejections."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    orders: tuple[str, ...]
    layouts: dict[str, np.ndarray]
    metrics: dict[str, np.ndarray]
    considered: int
    rejected: dict[int, int]
    seconds: float
    codes: np.ndarray = field(default=None)  # per evaluated layout: 0 feasible, else 10.. (memory, thresholds)
    engine: EngineSpec | None = None  # the engine predicted for (None: the cluster's values alone)
    bands: BandArrays | None = None  # per evaluated layout: its error band (plan3d.cost.bands)
    lifted_by: dict[int, str] = field(default_factory=dict)  # rejection code -> what would lift it

    def band(self, i: int) -> Band:
        """The error band of row `i`."""
        return self.bands.bands[int(self.bands.index[int(i)])]

    @property
    def size(self) -> int:
        return len(self.layouts["tp"])

    @property
    def feasible(self) -> np.ndarray:
        return self.codes == 0

    @property
    def feasible_count(self) -> int:
        return int(self.feasible.sum())

    def layout(self, i: int) -> Layout:
        return layout_at(self.layouts, self.orders, int(i), self.model.layers)

    def find(self, layout: Layout) -> int | None:
        """Row of `layout` among the evaluated ones, or None (invalid, or outside the space)."""
        if layout.order not in self.orders:
            return None
        if is_uneven(layout) and layout.pp_layers != balanced_split(self.model.layers, layout.pp * layout.vpp):
            return None
        row = layout_row(layout, self.orders)
        hit = np.ones(self.size, dtype=bool)
        for knob, value in row.items():
            hit &= self.layouts[knob] == value
        found = np.flatnonzero(hit)
        return int(found[0]) if len(found) else None

    def rejected_by_reason(self) -> dict[str, int]:
        """Reason -> count, largest first; a reason an option would lift names it."""
        def reason(code: int) -> str:
            return f"{REASONS[code]} ({self.lifted_by[code]})" if code in self.lifted_by else REASONS[code]
        return {reason(c): n for c, n in sorted(self.rejected.items(), key=lambda kv: -kv[1]) if n}

    def stats(self) -> dict:
        return {"layouts_considered": self.considered, "layouts_evaluated": self.size,
                "feasible": self.feasible_count, "seconds": round(self.seconds, 4),
                "layouts_per_s": round(self.considered / self.seconds) if self.seconds > 0 else None,
                "rejected": self.rejected_by_reason()}


def evaluate(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec,
             layouts: dict[str, np.ndarray], orders: tuple[str, ...],
             engine: EngineSpec | None = None) -> dict[str, np.ndarray]:
    """Predicted metrics of valid layouts as `engine` runs them: even splits in one vectorised call
    of the cost model, uneven splits in one call per pipeline degree (`evaluate_uneven`)."""
    uneven = layouts.get("uneven", np.zeros(len(layouts["tp"]), dtype=bool))
    if not uneven.any():
        return evaluate_even(cluster, model, training, layouts, orders, engine)
    parts = {}
    if (~uneven).any():
        parts[False] = evaluate_even(cluster, model, training, {k: a[~uneven] for k, a in layouts.items()}, orders,
                                     engine)
    parts[True] = evaluate_uneven(cluster, model, training, {k: a[uneven] for k, a in layouts.items()}, orders,
                                  engine)
    keys = list(parts[True])
    out = {k: np.empty(len(uneven), dtype=parts[True][k].dtype) for k in keys}
    for flag, metrics in parts.items():
        for k in keys:
            out[k][uneven == flag] = metrics[k]
    return out


def evaluate_uneven(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec,
                    layouts: dict[str, np.ndarray], orders: tuple[str, ...],
                    engine: EngineSpec | None = None) -> dict[str, np.ndarray]:
    """The metrics of uneven-split layouts (each with `balanced_split`), vectorised: one call of
    the cost model per pipeline degree, with every rank's layer count listed."""
    out = {}
    for pp in np.unique(layouts["pp"]):
        rows = layouts["pp"] == pp
        part = {k: a[rows] for k, a in layouts.items()}
        v_shape = schedules.column("v_shape", part["schedule"]) if "schedule" in part else np.zeros(len(part["tp"]), bool)
        metrics = evaluate_even(cluster, model, training, part, orders, engine,
                                rank_layers(model.layers, int(pp), part["vpp"], v_shape),
                                rank_moe_layers(model, int(pp), part["vpp"], v_shape) if model.moe is not None else None)
        for k, values in metrics.items():
            out.setdefault(k, np.empty(len(rows), dtype=values.dtype))[rows] = values
    return out


def rank_layers(layers: int, pp: int, vpps: np.ndarray, v_shape: np.ndarray | None = None) -> np.ndarray:
    """(pp, n) layers on each pipeline rank of the balanced split, its chunks placed as the
    schedule places them (r, r + pp, ...; or r and 2 pp - 1 - r under a V-shaped one)."""
    keys = _placements(vpps, v_shape)
    per = {k: schedules.per_rank(balanced_split(layers, pp * k[0]), pp, k[1]) for k in set(keys)}
    return np.array([per[k] for k in keys], dtype=np.float64).reshape(len(keys), pp).T


def rank_moe_layers(model: ModelSpec, pp: int, vpps: np.ndarray, v_shape: np.ndarray | None = None) -> np.ndarray:
    """(pp, n) MoE layers on each pipeline rank of the balanced split (`rank_layers`' layers)."""
    keys = _placements(vpps, v_shape)
    per = {k: schedules.per_rank(chunk_moe_layers(model, balanced_split(model.layers, pp * k[0])), pp, k[1])
           for k in set(keys)}
    return np.array([per[k] for k in keys], dtype=np.float64).reshape(len(keys), pp).T


def _placements(vpps: np.ndarray, v_shape: np.ndarray | None) -> list[tuple[int, bool]]:
    shapes = np.zeros(len(vpps), dtype=bool) if v_shape is None else np.asarray(v_shape, dtype=bool)
    return [(int(v), bool(s)) for v, s in zip(vpps, shapes)]


def evaluate_scalar(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec,
                    layouts: dict[str, np.ndarray], orders: tuple[str, ...],
                    engine: EngineSpec | None = None) -> dict[str, np.ndarray]:
    """The same metrics as `evaluate_even`, from `estimate()` one layout at a time (the reference
    the vectorised paths are tested against)."""

    rows = []
    for i in range(len(layouts["tp"])):
        d = estimate(cluster, model, training, layout_at(layouts, orders, i, model.layers), engine).to_dict()
        row = {k: d[k] for k in SCALAR_METRICS}
        row.update({f"{k}_s": v for k, v in d["time_s"].items()})
        rows.append(row)
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


SCALAR_METRICS = ("step_time_s", "tokens_per_s", "peak_memory_bytes", "capacity_bytes", "fits", *UTILISATION,
                  "model_tflops_per_gpu", "bubble_fraction", "recompute_layers")


def evaluate_even(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec,
                  layouts: dict[str, np.ndarray], orders: tuple[str, ...],
                  engine: EngineSpec | None = None, layers_per_rank: np.ndarray | None = None,
                  moe_layers_per_rank: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Predicted metrics of valid layouts, one vectorised call of the cost model (even splits, or
    the split `layers_per_rank` lists, with the MoE layers among them `moe_layers_per_rank`)."""

    cands = Candidates(tp=layouts["tp"], pp=layouts["pp"], dp=layouts["dp"],
                       micro_batch=layouts["micro_batch"], vpp=layouts["vpp"], zero=layouts["zero"],
                       recompute=layouts["recompute"], sequence_parallel=layouts["sequence_parallel"],
                       order=layouts["order"], cp=layouts.get("cp"), ep=layouts.get("ep"), etp=layouts.get("etp"),
                       schedule=layouts.get("schedule"))
    return estimate_batch(cluster, model, training, cands, tuple(orders), engine, layers_per_rank,
                          moe_layers_per_rank)


def refuse_model(engine: EngineSpec, model: ModelSpec, training: TrainingSpec | None = None) -> None:
    """No layout of a model the engine's code cannot build (`can_run.models`), or of a training its
    run choices refuse (`EngineSpec.training_problems`), is searched."""
    problems = engine.model_problems(model) + (engine.training_problems(training) if training is not None else [])
    if problems:
        raise LayoutError(problems[0])


def search(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, space: Space = Space(),
           min_mfu: float | None = None, max_memory_fraction: float | None = None,
           engine: EngineSpec | None = None) -> SearchResult:
    """Enumerate, prune, evaluate: the whole space for this cluster that `engine` can run (None:
    every layout, predicted with the cluster's values alone), with every rejection counted."""
    start = time.perf_counter()
    if engine is not None:
        refuse_model(engine, model, training)
        space = engine_space(space, engine)
    space = model_recompute_space(space, model, training)
    if model.moe is None:  # the engine's MoE-only rules do not apply
        space = replace(space, sequence_parallel_with_moe=False, moe_bias_with_tp=True)
    elif not model.bias:
        space = replace(space, moe_bias_with_tp=True)
    if engine is not None and engine.runs_as.cp_comm == "a2a":
        space = replace(space, cp_head_split=(model.heads, model.kv_heads_))
    space = replace(space, etp=expert_tp_choices(space, model, engine))
    require_some_ep(space, model, cluster.world_size)
    shapes = shape_grid(cluster.world_size, space, model.layers, training.seq_len or model.seq_len,
                        model.moe.experts if model.moe is not None else 0)
    if space.etp_fixed is not None:
        shapes = {k: a[shapes["etp"] == space.etp_fixed] for k, a in shapes.items()}
    codes = shape_reasons(shapes, model, training)
    if space.uneven:
        codes = allow_uneven(shapes, codes, model, training)
    per = space.layouts_per_shape
    rejected = {int(c): int(n) * per for c, n in enumerate(np.bincount(codes, minlength=10)) if c and n}
    valid = {k: a[codes == 0] for k, a in shapes.items()}
    layouts = expand_layouts(valid, space)
    layouts = drop_duplicates(layouts, space, rejected)
    require_within_budget(layouts, cluster)
    metrics = evaluate(cluster, model, training, layouts, space.orders, engine) if len(layouts["tp"]) else {}
    layouts, metrics = drop_idle_partial(layouts, metrics, rejected)
    bands = search_bands(cluster, model, training, layouts, engine)
    if metrics:
        metrics["step_band_low_s"] = metrics["step_time_s"] / (1 + bands.high)
        metrics["step_band_high_s"] = metrics["step_time_s"] / (1 + bands.low)
        metrics["band_tier"] = bands.tier
    fit_codes = fit_reasons(metrics, len(layouts["tp"]), min_mfu, max_memory_fraction, cluster.gpu.memory_bytes)
    for code in (MEMORY_CODE, MFU_CODE, MEMORY_FRACTION_CODE):
        rejected[code] = int((fit_codes == code).sum())
    return SearchResult(cluster, model, training, space.orders, layouts, metrics,
                        considered=len(codes) * per, rejected=rejected,
                        seconds=time.perf_counter() - start, codes=fit_codes, engine=engine, bands=bands,
                        lifted_by=lifting_options(space, engine))


def reevaluate(result: SearchResult, engine: EngineSpec, which: np.ndarray, min_mfu: float | None = None,
               max_memory_fraction: float | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """The evaluated layouts of `result` selected by `which`, predicted again as `engine` runs them
    (a run choice of the same engine, such as its activation offload): their indices in `result`,
    their metrics and their fit codes. Layouts whose recompute `engine.offload_problems` refuses are
    left out, and so are partial-recompute layouts that recompute no layer under it (the run of
    recompute none, `drop_idle_partial`): the indices are what that engine's own search keeps."""
    refused = [RECOMPUTE_CODES[m] for m in RECOMPUTE_MODES if engine.offload_problems(m)]
    keep = np.flatnonzero(np.asarray(which, dtype=bool) & ~np.isin(result.layouts["recompute"], refused))
    if not len(keep):
        return keep, {}, np.zeros(0, dtype=np.int8)
    layouts = {k: a[keep] for k, a in result.layouts.items()}
    metrics = evaluate(result.cluster, result.model, result.training, layouts, result.orders, engine)
    active = ~((layouts["recompute"] == RECOMPUTE_CODES["partial"]) & (metrics["recompute_layers"] == 0))
    keep, metrics = keep[active], {k: a[active] for k, a in metrics.items()}
    codes = fit_reasons(metrics, len(keep), min_mfu, max_memory_fraction, result.cluster.gpu.memory_bytes)
    return keep, metrics, codes


UNEVEN_CODE = 4  # "pp*vpp does not divide the layer count"


def lifting_options(space: Space, engine: EngineSpec | None) -> dict[int, str]:
    """What would lift a rejection of this search: the uneven-split refusal names --uneven where
    the engine runs uneven splits and was searched without them, or says the engine cannot."""
    if space.uneven or engine is None:
        return {}
    if engine.can_run.uneven_pipeline == "none":
        return {UNEVEN_CODE: f"{engine.name} splits layers evenly only; megatron-core and torchtitan run uneven splits"}
    return {UNEVEN_CODE: "--uneven lifts it"}


def search_bands(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, layouts: dict[str, np.ndarray],
                 engine: EngineSpec | None) -> BandArrays:
    """The error band of every evaluated layout (a few distinct regions: ZeRO-3 or not, cp or not)."""
    n = len(layouts["tp"])
    return band_arrays(engine.name if engine else "", cluster.gpu.generation_name, layouts["zero"],
                       layouts.get("cp", np.ones(n)), model.moe is not None, training.precision, cluster.world_size,
                       sharded_zero=sharded_stages(engine), schedule=layouts.get("schedule"),
                       offload=bool(engine and engine.runs_as.act_offload != "none"))


def drop_idle_partial(layouts: dict[str, np.ndarray], metrics: dict[str, np.ndarray],
                      rejected: dict[int, int]) -> tuple[dict, dict]:
    """Without the partial-recompute layouts that recompute no layer (every rank fits without:
    `recompute_layers` 0, the same run as recompute none), counted in `rejected`."""
    if not metrics:
        return layouts, metrics
    idle = (layouts["recompute"] == RECOMPUTE_CODES["partial"]) & (metrics["recompute_layers"] == 0)
    if idle.any():
        rejected[IDLE_PARTIAL_CODE] = int(idle.sum())
    return {k: a[~idle] for k, a in layouts.items()}, {k: a[~idle] for k, a in metrics.items()}


def fit_reasons(metrics: dict[str, np.ndarray], n: int, min_mfu: float | None,
                max_memory_fraction: float | None, gpu_memory_bytes: float) -> np.ndarray:
    """Per evaluated layout: 0 feasible, else the code of the first `plan3d.fit_rules.FIT_RULES`
    rule it fails (memory, MFU, memory fraction; the fraction is of the GPU's whole memory)."""
    if not n:
        return np.zeros(0, dtype=np.int8)
    return fit_codes(FitFacts.of(metrics, gpu_memory_bytes), n, Thresholds(min_mfu, max_memory_fraction))


# ---- cluster size: "how many nodes do I need" ---------------------------------------------------
def node_counts(min_nodes: int, max_nodes: int, limit: int = 16) -> list[int]:
    """Every count in [min, max] when there are at most `limit`; else doubling from min, plus max."""
    if min_nodes < 1 or max_nodes < min_nodes or max_nodes > MAX_NODES:
        raise LayoutError(f"--min-nodes {min_nodes} / --max-nodes {max_nodes}: need 1 <= min <= max <= {MAX_NODES:,}")
    if max_nodes - min_nodes < limit:
        return list(range(min_nodes, max_nodes + 1))
    counts, n = [], min_nodes
    while n < max_nodes:
        counts.append(n)
        n *= 2
    return counts + [max_nodes]


def sweep_nodes(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, counts: list[int],
                space: Space = Space(), engine: EngineSpec | None = None, **thresholds) -> list[SearchResult]:
    """One search per node count (same node type and fabric)."""
    return [search(cluster.with_size(nodes=n), model, training, space, engine=engine, **thresholds)
            for n in counts]


MAX_GPUS_TO_TRY = 131072  # beyond this a search takes seconds (rank maps of a million ranks)


def nodes_to_fit(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, space: Space = Space(),
                 max_factor: int = 64, engine: EngineSpec | None = None, **thresholds) -> int | None:
    """Fewest nodes above the cluster's count with a feasible layout, trying doublings of the count
    and powers of two (a count with an odd factor may have no valid layout at all), up to max_factor x
    (and at most MAX_GPUS_TO_TRY GPUs)."""
    top = min(cluster.nodes * max_factor, max(cluster.nodes, MAX_GPUS_TO_TRY // cluster.gpus_per_node))
    counts = {cluster.nodes * 2**k for k in range(1, max_factor.bit_length())}
    counts |= {2**k for k in range(top.bit_length()) if cluster.nodes < 2**k <= top}
    for nodes in sorted(n for n in counts if n <= MAX_NODES):
        try:
            result = search(cluster.with_size(nodes=nodes), model, training, space, engine=engine, **thresholds)
        except SearchBudgetError:  # larger clusters would be refused too
            return None
        if result.feasible_count:
            return nodes
    return None
