"""What plan3d's bundled runtime can train: the checks `plan3d launch` and every runtime worker
apply before starting (torch-free, and free of prediction code, so the runtime may import it)."""
from __future__ import annotations

from plan3d.plan import Plan
from plan3d.specs.catalog import RUNTIME_ENGINE, load_engine

RUNTIME_CP_COMM = ("all_gather", "p2p")  # plan3d.runtime.cp: gather_sequence, ring_attention


def runtime_problems(plan: Plan) -> list[str]:
    """What the bundled runtime cannot run (each says what to change)."""
    layout, model = plan.layout, plan.model
    problems = moe_problems(plan)
    if layout.cp > 1 and (plan.training.seq_len or model.seq_len) % (2 * layout.cp):
        problems.append(f"cp={layout.cp} splits each sequence into 2*cp chunks: seq="
                        f"{plan.training.seq_len or model.seq_len} must be divisible by {2 * layout.cp}")
    if layout.cp > 1 and plan.cp_comm not in RUNTIME_CP_COMM:
        problems.append(f"the bundled runtime exchanges K/V by {' or '.join(RUNTIME_CP_COMM)}, not {plan.cp_comm}; "
                        f"re-plan with --cp-comm {RUNTIME_CP_COMM[0]}")
    problems += load_engine(RUNTIME_ENGINE).model_problems(model)  # what its model code builds: can_run.models
    if model.vocab % layout.tp:
        problems.append(f"tp={layout.tp} does not divide vocab={model.vocab} (vocabulary-parallel output)")
    return problems


def moe_problems(plan: Plan) -> list[str]:
    """What the bundled runtime's MoE layers and expert parallelism (runtime/moe.py) cannot run."""
    layout, model, moe = plan.layout, plan.model, plan.model.moe
    problems = []
    if layout.etp is not None:
        problems.append(f"the bundled runtime splits experts over tp: drop etp={layout.etp}")
    if moe is None:
        if layout.ep > 1:
            problems.append(f"ep={layout.ep} needs MoE layers, and the model has none; set ep=1")
        return problems
    if moe.experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide experts={moe.experts}; choose an ep that divides it")
    if moe.capacity_factor is not None:
        problems.append("the bundled runtime routes dropless only; remove capacity_factor from the model's moe")
    widths = {"expert_ffn_hidden": moe.expert_ffn_hidden or model.ffn_hidden_, "shared_ffn_hidden": moe.shared_ffn_hidden}
    for name, width in widths.items():
        if width % layout.tp:
            problems.append(f"tp={layout.tp} does not divide {name}={width} (experts are split by tp)")
    return problems
