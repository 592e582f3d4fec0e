"""What every emitter shares: the emitted text with notes, the engine check.

An emitter writes a plan in the words of one engine release range. What the engine can run is
its engine profile's `can_run` (engine_specs/*.yaml, the same profile the time model reads), so
the search, `estimate` and `emit` refuse the same layouts with the same sentence.

Predictions follow the engine (issue 30): a plan emitted for another engine than the one it was
predicted for (or a plan with no engine) is re-estimated under the target profile
(`plan3d.cost.estimate.estimate`, as `plan3d estimate --engine` would), and the note gives both
predictions. A plan made for another engine whose layout would not fit in memory under the target
is refused: re-plan with `plan3d recommend --engine TARGET`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from plan3d.cost.estimate import Estimate as Prediction
from plan3d.cost.estimate import estimate
from plan3d.errors import InfeasibleError, LayoutError
from plan3d.plan import Plan
from plan3d.render.units import gib
from plan3d.specs.catalog import load_engine
from plan3d.specs.engine import RUN_CHOICES, EngineSpec


@dataclass
class Emitted:
    """What an emitter produced: the text to write, and notes for the user (stderr)."""

    text: str
    notes: list[str] = field(default_factory=list)


def _as_planned(engine: EngineSpec, plan: Plan, versions: str) -> EngineSpec:
    """The bundled profile running context parallelism's K/V exchange, the MoE token dispatcher and
    overlap, and the activation offload as the plan was predicted (`Plan.cp_comm`, `--cp-comm`;
    `Plan.ep_dispatcher`, `--ep-dispatcher`; `--ep-overlap`; `Plan.act_offload`, `--act-offload`).
    A plan made for this engine with a choice it cannot run is refused; one made for another
    engine keeps its choice where this engine runs it, else this engine's own (the emitter's note
    says the predictions were for the other engine)."""
    same = plan.engine is not None and plan.engine.name == engine.name
    for field, used, planned in (("cp_comm", plan.layout.cp > 1, plan.cp_comm),
                                 ("ep_dispatcher", plan.layout.ep > 1, plan.ep_dispatcher),
                                 ("ep_overlap", plan.layout.ep > 1, plan.ep_overlap),
                                 ("act_offload", True, plan.act_offload)):
        options, _, _, needs, _ = RUN_CHOICES[field]
        if not used or (needs and not getattr(engine.can_run, needs)):
            continue
        if not same and planned not in getattr(engine.can_run, options):
            continue
        try:
            engine = engine.with_choice(field, planned)
        except LayoutError as err:
            raise InfeasibleError(f"{engine.name} {versions}: {err}") from None
    return engine


def read_as_engine(plan: Plan, profile: str) -> tuple[Plan, list[str]]:
    """The plan with a ZeRO stage the engine reads as another (`EngineSpec.zero_read_as`: a
    published "ZeRO-2" Megatron run with pp > 1 is its distributed optimizer), as `estimate` and
    `check` read it, and the note saying so; the plan itself where nothing is read otherwise."""
    engine = load_engine(profile)
    note = engine.zero_note(plan.layout)
    if note is None:
        return plan, []
    return plan.model_copy(update={"layout": engine.zero_read_as(plan.layout)}), [note]


def target_engine(plan: Plan, profile: str, versions: str) -> tuple[EngineSpec, list[str]]:
    """The engine profile an emitter writes for, after refusing what it cannot run.

    Raises InfeasibleError naming the engine release range and every reason (each says what to
    change). Returns the profile and, when the plan was predicted for another engine or for none,
    a note comparing the plan's prediction with the layout's estimate under this profile
    (`reestimate_note`); a plan of another engine whose layout would not fit under this one is
    refused."""
    engine = _as_planned(load_engine(profile), plan, versions)
    problems = engine.job_problems(plan.layout, plan.model, plan.training)
    if problems:
        raise InfeasibleError(f"{profile} {versions} cannot run {plan.layout.short()}: " + "; ".join(problems))
    notes = []
    if plan.engine is None or plan.engine.name != engine.name:
        notes.append(reestimate_note(plan, engine, versions))
    return engine, notes


def reestimate(plan: Plan, engine: EngineSpec) -> Prediction:
    """The plan's layout estimated under `engine` (its cluster, model and training as planned)."""
    return estimate(plan.cluster, plan.model, plan.training, plan.layout, engine)


def reestimate_note(plan: Plan, engine: EngineSpec, versions: str) -> str:
    """'the plan's predictions are for engine A (step 9.81 s, peak 55.2 GiB); under B this layout is
    predicted at step 10.30 s (+5.0%), peak 61.0 GiB (+5.8 GiB)'. Raises InfeasibleError when the
    plan was made for another engine and the layout would run out of memory under `engine`; a plan
    with no engine gets the warning in its note instead."""
    try:
        fresh = reestimate(plan, engine)
    except LayoutError as err:  # a layout no engine runs (load_plan refuses it; a hand-built plan): the emitter says why
        return f"the layout could not be estimated under {engine.name}: {err}"
    stored = plan.estimate
    step = _stored(stored, "step_time_s")
    peak = _stored(stored, "peak_memory_bytes")
    mfu = _stored(stored, "mfu") if stored is not None and stored.given("mfu_noncausal") else None  # causal MFU
    if not fresh.fits and plan.engine is not None:
        raise InfeasibleError(
            f"{engine.name} {versions}: {plan.layout.short()} would run out of memory: "
            f"{_oom(fresh)}" + (f" (the plan's {plan.engine.name} prediction: peak {gib(peak)})" if peak else "")
            + f"; plan for this engine with `plan3d recommend --engine {engine.name} ... --out PLAN.json`")
    figures = [f"step {fresh.step_time_s:.2f} s{_change(fresh.step_time_s, step)}",
               f"peak {gib(fresh.peak_memory_bytes)}" + (f" ({_signed_gib(fresh.peak_memory_bytes - peak)})"
                                                         if peak is not None else ""),
               f"MFU {fresh.mfu:.1%}" + (f" ({(fresh.mfu - mfu) * 100:+.1f} points)" if mfu is not None else "")]
    made_for = f"engine {plan.engine.name}" if plan.engine is not None else "no engine"
    held = [f"step {step:.2f} s" if step is not None else "",
            f"peak {gib(peak)}" if peak is not None else "",
            f"MFU {mfu:.1%}" if mfu is not None else ""]
    held = [h for h in held if h]
    before = (f"the plan's predictions are for {made_for} ({', '.join(held)})" if held
              else f"the plan has no predictions ({made_for})")
    note = f"{before}; under {engine.name} this layout is predicted at {', '.join(figures)}"
    if not fresh.fits:
        note += f"; IT WOULD RUN OUT OF MEMORY under {engine.name}: {_oom(fresh)}; plan for this engine with " \
                f"`plan3d recommend --engine {engine.name} ... --out PLAN.json`"
    return note


def _stored(record, key: str) -> float | None:
    """A field of the plan's estimate record, None where the record or the field is missing (older plans)."""
    value = getattr(record, key, None) if record is not None else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _change(value: float, before: float | None) -> str:
    return f" ({value / before - 1:+.1%})" if before else ""


def _signed_gib(n_bytes: float) -> str:
    return ("+" if n_bytes >= 0 else "-") + gib(abs(n_bytes))


def _oom(fresh: Prediction) -> str:
    return (f"pipeline rank {fresh.worst_pp_rank} needs {gib(fresh.peak_memory_bytes)} per GPU of "
            f"{gib(fresh.capacity_bytes)} usable")
