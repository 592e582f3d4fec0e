"""Multi-rank layouts train exactly like one process (loss per step within 1e-5), and every rank's
measured model-state bytes equal the memory model's prediction (fp32 on CPU) within 1%.

Four ranks show the same group arithmetic as eight (each layout below splits every dimension it
uses at least in two); the one 3D layout (tp2 pp2 dp2) runs on eight. ZeRO-1 and ZeRO-2 on pure
data parallelism are launched by test_runtime_cp (cp2 dp2 ZeRO-1: ZeRO over dp x cp) and
test_runtime_failures (dp2 ZeRO-2, resumed after a crash), with the same checks.
"""
from __future__ import annotations

import pytest

from runtime_helpers import (TOKEN_DATA, check_completed_run, check_model_state, launched, llama_style, make_plan,
                             metrics, summary)

# Older names, kept for the modules that import them from here.
_check_model_state = check_model_state
__all__ = ["llama_style", "_check_model_state"]

LAYOUTS = {
    "pp4-interleaved-vpp2-full-recompute": dict(pp=4, vpp=2, recompute="full"),
    "tp2-sequence-parallel-dp2-zero2-selective-recompute": dict(tp=2, dp=2, sequence_parallel=True, zero=2,
                                                                recompute="selective"),
    "dp4-zero3": dict(dp=4, zero=3),
    "pp2-dp2-zero3-uneven-3-5": dict(pp=2, dp=2, zero=3, pp_layers=(3, 5)),
    # the schedules torch.distributed.pipelining provides beyond 1F1B (bundled/pipeline_schedules.yaml)
    "pp4-zbv-v-shaped": dict(pp=4, vpp=2, schedule="zbv"),
    "pp4-dualpipev": dict(pp=4, vpp=2, schedule="dualpipev"),
    "pp2-dp2-zbv-zero1": dict(pp=2, dp=2, vpp=2, schedule="zbv", zero=1),
    "pp4-zb1p-vpp2-selective": dict(pp=4, vpp=2, schedule="zb1p", recompute="selective"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    plan = make_plan(**LAYOUTS[name])
    assert plan.layout.world_size == 4
    launched(plan, tmp_path)
    check_completed_run(plan, tmp_path, reference)


@pytest.mark.slow
def test_bf16_mixed_precision_model_states_match_the_memory_model(reference, tmp_path):
    """bf16 weights, fp32 main gradients, fp32 master + Adam (forced on CPU with --precision bf16),
    ZeRO-2 over dp and bf16 activations sent between pipeline stages."""
    plan = make_plan(pp=2, dp=2, zero=2)
    launched(plan, tmp_path, extra=["--no-save", "--precision", "bf16"])
    done = summary(tmp_path)
    assert done["precision"] == "bf16"
    bf16_plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": "bf16"})})
    check_model_state(bf16_plan, done["ranks"])
    for step, loss in metrics(tmp_path).items():
        assert abs(loss - reference[step]) < 0.02, f"step {step}: bf16 {loss} vs fp32 {reference[step]}"


@pytest.mark.slow
def test_llama_style_tied_tp2_pp2_dp2_zero1_on_token_data_matches_single_process(llama_reference, tmp_path):
    """GQA + SwiGLU + RoPE + RMSNorm, tied embeddings split over two stages (gradients summed
    over the embedding group), a non-default rank order, ZeRO-1; trained on the bundled text
    (`--data python-docs`), so the token file's global batch is the same in both layouts and
    each dp rank takes its rows of it."""
    plan = llama_style(make_plan(tp=2, pp=2, dp=2, zero=1, order="tp-cp-ep-pp-dp"))
    launched(plan, tmp_path, extra=["--no-save", *TOKEN_DATA])
    check_completed_run(plan, tmp_path, llama_reference)
    assert summary(tmp_path)["data"]["path"].endswith("python-docs.bin")
