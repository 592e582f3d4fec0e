"""Expert parallelism in the bundled runtime, launched over gloo (plan3d/runtime/moe.py).

The model is tiny-moe (8 experts, top 2, every second layer) with a gated shared expert, so that
routing, the all-to-all dispatch, the shared experts and their gate all run. One single-process
run (the module's reference) and three multi-rank runs, 4 steps each:
- ep2 dp2 (4 ranks) with ZeRO-3 (FSDP2: each expert its own unit over edp), checkpoints at
  steps 2 and 4: losses 1-4 equal one process;
- ep2 dp4 tp2 with sequence parallelism and ZeRO-1 (8 ranks; experts sharded over edp = 2),
  resumed from the ep2 dp2 run's step 2 (a reshard: tp 1 -> 2, edp 1 -> 2, FSDP2 shards -> flat
  ZeRO-1 buffers): losses 3-4;
- ep4 dp2 cp2 pp2 with ZeRO-2 and full recompute (8 ranks; ep folded out of dp x cp): losses 1-4.
Every step's loss (within 1e-5) and gradient norm equal one process's; every rank's model-state
bytes equal the MoE accounting contract (docs/runtime.md: the dense part sharded over dp x cp,
experts/ep local experts over edp = dp*cp/ep), computed here from `plan3d.cost.params`, and
`plan3d.cost.memory.model_state_bytes`.
"""
from __future__ import annotations

import json

import pytest

from runtime_helpers import STEPS, assert_same_losses, metrics, run, summary

BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}  # fp32 with Adam: the master is the parameter


def moe_plan(**layout_flags):
    """A tiny-moe plan with a gated shared expert of width 32."""
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.layout import check_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("local-cpu", "tiny-moe", None, None, None, None, "fp32")
    model = model.model_copy(update={"moe": model.moe.model_copy(update=dict(shared_ffn_hidden=32, shared_expert_gate=True))})
    layout = make_layout(**layout_flags)
    check_layout(layout, model, training, cluster.world_size)
    return build_plan(cluster, model, training, layout, {})


def grad_norms(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["grad_norm"] for r in map(json.loads, lines)}


def assert_same_norms(got: dict[int, float], want: dict[int, float], steps) -> None:
    """The global gradient norm (before clipping) of every step: each expert element counted once."""
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-4 * want[step], f"step {step}: norm {got[step]} vs {want[step]}"


def _launch(plan, run_dir, extra=("--no-save",)) -> list[dict]:
    result = run(plan, run_dir, extra=list(extra))
    assert result.ok, f"{result.failed_rank}: {result.error}"
    return summary(run_dir)["ranks"]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The single-process run's directory (its losses must fall: the synthetic data is learnable)."""
    run_dir = tmp_path_factory.mktemp("moe-reference")
    _launch(moe_plan(), run_dir)
    losses = metrics(run_dir)
    assert losses[STEPS] < losses[1]
    return run_dir


def assert_same_run(run_dir, reference, steps=range(1, STEPS + 1)) -> None:
    assert_same_losses(metrics(run_dir), metrics(reference), steps)
    assert_same_norms(grad_norms(run_dir), grad_norms(reference), steps)


@pytest.fixture(scope="module")
def ep2_dp2(tmp_path_factory):
    """The ep2 dp2 ZeRO-3 run (checkpoints at steps 2 and 4): its plan, directory and ranks."""
    run_dir = tmp_path_factory.mktemp("moe-ep2-dp2")
    plan = moe_plan(ep=2, dp=2, zero=3)
    return plan, run_dir, _launch(plan, run_dir, extra=("--save-every", "2"))


# ---- the accounting contract ----------------------------------------------------------------------
def _split(model, count: int, replicated: int, tp: int) -> float:
    """One rank's share of `count` parameters of which `replicated` are not split by tp."""
    return (count - replicated) / tp + replicated


def contract_params(model, layout, pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline stage `pp_rank` holds: row-parallel output
    biases, norms, the router and the shared gate replicated over tp, the rest split; experts/ep
    local experts per MoE layer."""
    from plan3d.cost.params import attention_params, embedding_params, ffn_params, moe_shared_params, norm_params

    h, tp, moe = model.hidden, layout.tp, model.moe
    out_bias = h if model.bias else 0
    attention = _split(model, attention_params(model), out_bias, tp) + 2 * norm_params(model)
    dense_mlp = _split(model, ffn_params(model, model.ffn_hidden_), out_bias, tp)
    shared_ffn = ffn_params(model, moe.shared_ffn_hidden) if moe.shared_ffn_hidden else 0
    moe_dense = moe_shared_params(model) - shared_ffn + (_split(model, shared_ffn, out_bias, tp) if shared_ffn else 0)
    expert = _split(model, ffn_params(model, moe.expert_ffn_hidden or model.ffn_hidden_), out_bias, tp)
    dense = experts = 0.0
    for i in _stage_layers(layout, model.layers, pp_rank):
        dense += attention + (moe_dense if model.is_moe_layer(i) else dense_mlp)
        experts += moe.experts // layout.ep * expert if model.is_moe_layer(i) else 0
    if pp_rank == 0:
        dense += embedding_params(model) - model.vocab * h + model.vocab * h / tp
    if pp_rank == layout.pp - 1:
        dense += norm_params(model) + (0 if model.tied_embeddings else model.vocab * h / tp)
    return dense, experts


def _stage_layers(layout, layers: int, pp_rank: int) -> list[int]:
    counts, start, mine = layout.stage_layers(layers), 0, []
    for stage, n in enumerate(counts):
        if stage % layout.pp == pp_rank:
            mine += range(start, start + n)
        start += n
    return mine


def contract_bytes(model, layout, pp_rank: int) -> dict[str, float]:
    dense, experts = contract_params(model, layout, pp_rank)
    dp_cp = layout.dp * layout.cp
    edp = dp_cp // layout.ep
    stage = {"weights": 3, "gradients": 2, "optimizer": 1}  # ZeRO stage from which the kind is sharded
    return {kind: per * (dense / (dp_cp if layout.zero >= stage[kind] else 1) +
                         experts / (edp if layout.zero >= stage[kind] else 1)) for kind, per in BYTES.items()}


def check_model_state(plan, ranks: list[dict]) -> None:
    """Measured bytes equal the contract (the flat ZeRO buffers pad to a multiple of the shard
    count: within 0.1%) and `model_state_bytes`."""
    from plan3d.cost.memory import model_state_bytes

    assert len(ranks) == plan.layout.world_size
    for r in ranks:
        want = contract_bytes(plan.model, plan.layout, r["pp"])
        model = model_state_bytes(plan.model, plan.training, plan.layout, r["pp"])
        for kind in BYTES:
            got = r["model_state_bytes"][kind]
            assert abs(got - want[kind]) <= 1e-3 * want[kind], f"rank {r['rank']} {kind}: {got} vs contract {want[kind]}"
            assert abs(model[kind] - want[kind]) <= 1e-3 * want[kind], f"{kind}: model_state_bytes {model[kind]} vs contract {want[kind]}"


def check_expert_groups(plan, ranks: list[dict]) -> None:
    for dim in ("ep", "edp", "tp", "pp"):
        got = sorted({tuple(r["mesh_groups"][dim]) for r in ranks})
        assert got == sorted(tuple(g) for g in plan.rankmap.groups[dim]), dim


# ---- launched ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ep2_dp2_zero3_matches_single_process(moe_reference, ep2_dp2):
    plan, run_dir, ranks = ep2_dp2
    assert_same_run(run_dir, moe_reference)
    check_expert_groups(plan, ranks)
    check_model_state(plan, ranks)
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()


@pytest.mark.slow
def test_ep2_dp4_tp2_sequence_parallel_zero1_resumes_the_ep2_dp2_checkpoint(moe_reference, ep2_dp2, tmp_path):
    """Experts resharded from (ep2, tp1, edp1, FSDP2) to (ep2, tp2, edp2, flat ZeRO-1); the run
    continues exactly."""
    _, source, _ = ep2_dp2
    plan = moe_plan(ep=2, dp=4, tp=2, sequence_parallel=True, zero=1)
    ranks = _launch(plan, tmp_path, extra=("--no-save", "--resume-from", str(source / "checkpoints" / "step_00000002")))
    got = metrics(tmp_path)
    assert min(got) == 1 and max(got) == STEPS  # the first two steps inherited from the source run
    assert_same_run(tmp_path, moe_reference, range(3, STEPS + 1))
    check_expert_groups(plan, ranks)
    check_model_state(plan, ranks)


@pytest.mark.slow
def test_ep4_dp2_cp2_pp2_zero2_full_recompute_matches_single_process(moe_reference, tmp_path):
    plan = moe_plan(ep=4, dp=2, cp=2, pp=2, zero=2, recompute="full")
    ranks = _launch(plan, tmp_path)
    assert_same_run(tmp_path, moe_reference)
    check_expert_groups(plan, ranks)
    check_model_state(plan, ranks)
