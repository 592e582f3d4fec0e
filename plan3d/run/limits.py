"""What plan3d's bundled runtime can train: the checks `plan3d launch` and every runtime worker
apply before starting (torch-free, and free of prediction code, so the runtime may import it).

The runtime's capabilities are its engine profile, engine_specs/plan3d-runtime.yaml, read by the
one evaluator every engine has (`EngineSpec.layout_problems`: ZeRO with pp, recompute modes,
orders, etp, the model code it builds) and its `can_run.cp_comm`; the layout rules themselves
(ep dividing the experts, seq divisible by 2 * cp, ...) are `plan3d.layout.layout_problems`, read
here too (a plan passed them when it was loaded; one edited in memory may not have). What is left
here is what only this runtime's code cannot do.
"""
from __future__ import annotations

from plan3d.layout import job_problems
from plan3d.plan import Plan
from plan3d.specs.catalog import RUNTIME_ENGINE, load_engine


def runtime_cp_comm() -> tuple[str, ...]:
    """The K/V exchanges the runtime runs (plan3d.runtime.cp), from its profile."""
    return tuple(load_engine(RUNTIME_ENGINE).can_run.cp_comm)


def runtime_problems(plan: Plan) -> list[str]:
    """What the bundled runtime cannot run (each says what to change)."""
    layout, model = plan.layout, plan.model
    runtime = load_engine(RUNTIME_ENGINE)
    problems = job_problems(layout, model, plan.training, plan.cluster.world_size, runtime)  # a hand-edited plan too
    problems += moe_problems(plan)
    if layout.cp > 1 and plan.cp_comm not in runtime.can_run.cp_comm:
        exchanges = runtime_cp_comm()
        problems.append(f"the bundled runtime exchanges K/V by {' or '.join(exchanges)}, not {plan.cp_comm}; "
                        f"re-plan with --cp-comm {exchanges[0]}")
    if layout.pp > 1 and layout.v_shape and model.tied_embeddings:
        problems.append(f"the bundled runtime sums tied embedding gradients between the first and the last pipeline "
                        f"rank; under the V-shaped {layout.pipeline_schedule} schedule both ends sit on rank 0: untie "
                        "the embeddings (tied_embeddings: false) or use a loop schedule (1f1b, interleaved-1f1b, zb1p)")
    if model.vocab % layout.tp:
        problems.append(f"tp={layout.tp} does not divide vocab={model.vocab} (vocabulary-parallel output)")
    return problems


def moe_problems(plan: Plan) -> list[str]:
    """What the bundled runtime's MoE layers (runtime/moe.py) cannot run beyond its profile."""
    layout, model, moe = plan.layout, plan.model, plan.model.moe
    if moe is None:
        return []
    problems = []
    if moe.capacity_factor is not None:
        problems.append("the bundled runtime routes dropless only; remove capacity_factor from the model's moe")
    widths = {"expert_ffn_hidden": moe.expert_ffn_hidden or model.ffn_hidden_, "shared_ffn_hidden": moe.shared_ffn_hidden}
    for name, width in widths.items():
        if width % layout.tp:
            problems.append(f"tp={layout.tp} does not divide {name}={width} (experts are split by tp)")
    return problems
