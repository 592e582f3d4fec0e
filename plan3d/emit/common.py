"""What every emitter shares: the emitted text with notes, rank-order equivalence, the engine check.

An emitter writes a plan in the words of one engine release range. What the engine can run is
its engine profile's `can_run` (engine_specs/*.yaml, the same profile the time model reads), so
the search, `estimate` and `emit` refuse the same layouts with the same sentence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from plan3d.errors import InfeasibleError, LayoutError
from plan3d.layout import Layout
from plan3d.plan import Plan
from plan3d.specs.catalog import load_engine
from plan3d.specs.engine import EngineSpec


@dataclass
class Emitted:
    """What an emitter produced: the text to write, and notes for the user (stderr)."""

    text: str
    notes: list[str] = field(default_factory=list)


def same_groups(layout: Layout, supported_order: str) -> bool:
    """True when `layout.order` builds the same groups as `supported_order` for this layout (the
    search's rule: `Layout.same_groups_as`)."""
    return layout.same_groups_as(supported_order)


def _as_planned(engine: EngineSpec, plan: Plan, versions: str) -> EngineSpec:
    """The bundled profile running context parallelism's K/V exchange as the plan was predicted
    (`Plan.cp_comm`, `--cp-comm`). A plan made for this engine with an exchange it cannot run is
    refused; one made for another engine keeps its exchange where this engine runs it, else this
    engine's own (the emitter's note says the predictions were for the other engine)."""
    if plan.layout.cp == 1 or not engine.can_run.context_parallel:
        return engine
    same = plan.engine is not None and plan.engine.name == engine.name
    if not same and plan.cp_comm not in engine.can_run.cp_comm:
        return engine
    try:
        return engine.with_cp_comm(plan.cp_comm)
    except LayoutError as err:
        raise InfeasibleError(f"{engine.name} {versions}: {err}") from None


def target_engine(plan: Plan, profile: str, versions: str) -> tuple[EngineSpec, list[str]]:
    """The engine profile an emitter writes for, after refusing what it cannot run.

    Raises InfeasibleError naming the engine release range and every reason (each says what to
    change). Returns the profile and a note when the plan was predicted for another engine."""
    engine = _as_planned(load_engine(profile), plan, versions)
    problems = engine.layout_problems(plan.layout, plan.model)
    if problems:
        raise InfeasibleError(f"{profile} {versions} cannot run {plan.layout.short()}: " + "; ".join(problems))
    notes = []
    if plan.engine is not None and plan.engine.name != engine.name:
        notes.append(f"the plan's predictions are for engine {plan.engine.name}; re-estimate with "
                     f"--engine {engine.name} to predict this engine")
    return engine, notes
