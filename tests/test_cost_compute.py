"""FLOP counts and the compute/communication/pipeline formulas against hand values."""
import numpy as np
import pytest

from plan3d.cost import comm, compute
from plan3d.cost.context import make_context
from plan3d.cost.pipeline import pipeline_s
from plan3d.specs.catalog import load_cluster
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

GPT = ModelSpec(name="gpt", layers=24, hidden=2048, heads=16, vocab=50257, seq_len=2048)


def test_model_flops_reduce_to_classic_gpt_formula():
    """Non-causal: 72 B s L h^2 (1 + s/6h + V/12Lh) (Narayanan et al. 2021); causal: the s^2 term
    halved, 72 B s L h^2 (1 + s/12h + V/12Lh) (PaLM appendix B)."""
    training = TrainingSpec(global_batch=512)
    ctx = make_context(None, GPT, training)
    B, s, L, h, V = 512, 2048, 24, 2048, 50257
    classic = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    causal = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert compute.model_flops_per_step(ctx, causal=False) == pytest.approx(classic, rel=1e-12)
    assert compute.model_flops_per_step(ctx) == pytest.approx(causal, rel=1e-12)


@pytest.mark.parametrize("recompute, extra", [("none", 0.0), ("selective", 1.0), ("full", None)])
def test_hardware_flops_add_the_recompute_pass(recompute, extra):
    """Full recompute: 96 B s L h^2 (1 + s/6h + V/16Lh) (Narayanan et al. 2021's hardware FLOPs);
    selective: one more attention-core forward, 4 B s^2 h per layer (Korthikanti et al. 2022)."""
    from plan3d.vocab import RECOMPUTE_CODES
    ctx = make_context(None, GPT, TrainingSpec(global_batch=512))
    B, s, L, h, V = 512, 2048, 24, 2048, 50257
    model = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    expected = (96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)) if extra is None
                else model + extra * L * 4 * B * s**2 * h)
    assert float(compute.hardware_flops_per_step(ctx, RECOMPUTE_CODES[recompute])) == pytest.approx(expected, rel=1e-12)


def test_gqa_and_swiglu_change_the_gemm_flops_as_their_shapes_say():
    training = TrainingSpec(global_batch=1)
    base = compute.layer_gemm_flops(make_context(None, GPT, training), 1)
    gqa = compute.layer_gemm_flops(make_context(None, GPT.model_copy(update={"kv_heads": 4}), training), 1)
    assert base - gqa == pytest.approx(2 * 2 * 2048 * (2048 - 512))  # K and V shrink to 4 heads
    swiglu = GPT.model_copy(update={"activation": "swiglu", "ffn_hidden": 4096})
    assert compute.layer_gemm_flops(make_context(None, swiglu, training), 1) == pytest.approx(
        2 * (4 * 2048**2 + 3 * 2048 * 4096))


def test_gemm_time_is_saturating_efficiency():
    cluster = load_cluster("dgx-a100-80g")
    ctx = make_context(cluster, GPT, TrainingSpec(global_batch=1))
    w = 1e12
    eff = ctx.gemm_max_fraction * w / (w + ctx.gemm_half_work_flops)
    assert compute.gemm_s(ctx, w, 1) == pytest.approx(w / (eff * ctx.peak_flops))


def test_collectives_by_hand():
    assert comm.all_reduce_s(8e9, 8, 1e11, 1e-5) == pytest.approx(2 * 7 / 8 * 8e9 / 1e11 + 14e-5)
    assert comm.all_gather_s(8e9, 4, 1e11, 0.0) == pytest.approx(3 / 4 * 8e9 / 1e11)
    assert comm.all_reduce_s(8e9, 1, 1e11, 1e-5) == 0
    assert comm.p2p_s(1e9, 1e10, 2e-6) == pytest.approx(0.1 + 2e-6)


def test_one_f_one_b_step_is_m_plus_p_minus_1_stage_times():
    stage = np.full((4, 1), 2.0)
    step, bubble = pipeline_s(stage, np.ones_like(stage), np.array([8.0]), np.array([1.0]))
    assert step[0] == pytest.approx((8 + 4 - 1) * 2.0)
    assert bubble[0] / (8 * 2.0) == pytest.approx((4 - 1) / 8)
    _, interleaved = pipeline_s(stage, np.ones_like(stage), np.array([8.0]), np.array([2.0]))
    assert interleaved[0] == pytest.approx(bubble[0] / 2)


def test_slowest_stage_paces_the_pipeline():
    stage = np.array([[1.0], [3.0], [1.0]])
    step, _ = pipeline_s(stage, np.ones_like(stage), np.array([10.0]), np.array([1.0]))
    assert step[0] == pytest.approx(10 * 3.0 + 2.0)


def test_dp_group_across_nodes_uses_k_nic_shares():
    from plan3d.layout import Layout

    cluster = load_cluster("dgx-a100-80g", nodes=4)
    tiers = tuple(cluster.tiers())
    link = comm.group_link(Layout(tp=2, dp=16), "dp", tiers, cluster.gpus_per_node)
    assert link.tier == tiers[1].name
    assert link.bytes_per_s == pytest.approx(min(tiers[0].effective_bytes_per_s, 4 * tiers[1].effective_bytes_per_s))
