"""8-rank layouts train exactly like one process (loss per step within 1e-5), and every rank's
measured model-state bytes equal the memory model's prediction (fp32 on CPU) within 1%."""
from __future__ import annotations

import json

import pytest

from runtime_helpers import STEPS, assert_same_losses, make_plan, metrics, run, summary

LAYOUTS = {
    "pp4-interleaved-vpp2-dp2-full-recompute": dict(pp=4, vpp=2, dp=2, recompute="full"),
    "tp4-sequence-parallel-dp2-zero2-selective-recompute": dict(tp=4, dp=2, sequence_parallel=True, zero=2,
                                                                recompute="selective"),
    "dp8-zero1": dict(dp=8, zero=1),
    "dp8-zero2": dict(dp=8, zero=2),
    "dp8-zero3": dict(dp=8, zero=3),
    "pp2-dp4-zero3-uneven-3-5": dict(pp=2, dp=4, zero=3, pp_layers=(3, 5)),
}


def llama_style(plan):
    """tiny-gpt reshaped like Llama: GQA (2 kv heads), SwiGLU, RMSNorm, RoPE, no biases, tied embeddings."""
    from plan3d.plan import build_plan

    model = plan.model.model_copy(update=dict(name="tiny-llama", kv_heads=2, activation="swiglu", ffn_hidden=128,
                                              norm="rmsnorm", bias=False, position="rope", tied_embeddings=True))
    return build_plan(plan.cluster, model, plan.training, plan.layout, {})


def _check_model_state(plan, ranks: list[dict]) -> None:
    from plan3d.cost.memory import model_state_bytes

    assert len(ranks) == plan.layout.world_size
    for r in ranks:
        want = model_state_bytes(plan.model, plan.training, plan.layout, r["pp"])
        for kind in ("weights", "gradients", "optimizer"):
            got = r["model_state_bytes"][kind]
            assert abs(got - want[kind]) <= 0.01 * want[kind], f"rank {r['rank']} {kind}: {got} vs model {want[kind]}"


def _check_mesh_groups(plan, ranks: list[dict]) -> None:
    """The DeviceMesh built from the rank map holds exactly the plan's groups."""
    for dim in ("tp", "dp", "pp"):
        got = sorted({tuple(r["mesh_groups"][dim]) for r in ranks})
        assert got == sorted(tuple(g) for g in plan.rankmap.groups[dim]), dim


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    plan = make_plan(**LAYOUTS[name])
    assert plan.layout.world_size == 8
    result = run(plan, tmp_path, extra=["--no-save"])
    assert result.ok, f"{result.failed_rank}: {result.error}"
    assert_same_losses(metrics(tmp_path), reference, range(1, STEPS + 1))
    ranks = summary(tmp_path)["ranks"]
    _check_model_state(plan, ranks)
    _check_mesh_groups(plan, ranks)
    _check_phases(tmp_path)


def _check_phases(run_dir) -> None:
    """Every step record carries its phase timings, and they add up to the step time."""
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        phases = record["phases_s"]
        assert set(phases) == {"forward_backward", "grad_reduce", "clip", "optimizer", "loss"}
        assert all(v >= 0 for v in phases.values())
        assert abs(sum(phases.values()) - record["step_time_s"]) < 1e-3 * record["step_time_s"]


@pytest.mark.slow
def test_bf16_mixed_precision_model_states_match_the_memory_model(reference, tmp_path):
    """bf16 weights, fp32 main gradients, fp32 master + Adam (forced on CPU with --precision bf16)."""
    plan = make_plan(tp=2, pp=2, dp=2, zero=2)
    result = run(plan, tmp_path, extra=["--no-save", "--precision", "bf16"])
    assert result.ok, f"{result.failed_rank}: {result.error}"
    done = summary(tmp_path)
    assert done["precision"] == "bf16"
    bf16_plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": "bf16"})})
    _check_model_state(bf16_plan, done["ranks"])
    for step, loss in metrics(tmp_path).items():
        assert abs(loss - reference[step]) < 0.02, f"step {step}: bf16 {loss} vs fp32 {reference[step]}"


@pytest.mark.slow
def test_llama_style_tied_tp2_pp2_dp2_zero1_on_token_data_matches_single_process(tmp_path):
    """GQA + SwiGLU + RoPE + RMSNorm, tied embeddings split over two stages (gradients summed
    over the embedding group), a non-default rank order, ZeRO-1; trained on the bundled text
    (`--data python-docs`), so the token file's global batch is the same in both layouts and
    each dp rank takes its rows of it."""
    data = ["--no-save", "--data", "python-docs"]
    single = llama_style(make_plan())
    assert run(single, tmp_path / "one", extra=data).ok
    plan = llama_style(make_plan(tp=2, pp=2, dp=2, zero=1, order="tp-cp-ep-pp-dp"))
    result = run(plan, tmp_path / "eight", extra=data)
    assert result.ok, f"{result.failed_rank}: {result.error}"
    assert_same_losses(metrics(tmp_path / "eight"), metrics(tmp_path / "one"), range(1, STEPS + 1))
    assert summary(tmp_path / "eight")["data"]["path"].endswith("python-docs.bin")
    ranks = summary(tmp_path / "eight")["ranks"]
    _check_model_state(plan, ranks)
    _check_mesh_groups(plan, ranks)
