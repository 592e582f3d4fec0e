"""torchtitan's selective recompute (`RunsAs.selective: per-op`, SelectiveAC, with the fused QKV
torchtitan builds): what a dense layer
keeps, what one layer's backward rebuilds, and what the recompute pass costs, by hand; Megatron's
selective (the attention core) is untouched."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.cost import core, memory
from plan3d.cost.arrays import layout_arrays
from plan3d.cost.context import make_context
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

# Llama-like: h 64, 4 heads of 16, 2 KV heads, SwiGLU 192, seq 32
DENSE = ModelSpec(name="sac", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=192, vocab=256, seq_len=32,
                  activation="swiglu", norm="rmsnorm", position="rope", bias=False)
TRAINING = TrainingSpec(global_batch=8, precision="bf16")


def one(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def arrays(recompute: str, tp: int = 1, pp: int = 1):
    return layout_arrays(8, [tp], [pp], [1], [1], [1], [1], [RECOMPUTE_CODES[recompute]], [int(tp > 1)])


@pytest.mark.parametrize("tp", [1, 2])
def test_per_op_policy_keeps_the_input_every_other_linear_the_attention_and_the_collectives(tp):
    ctx = make_context(None, DENSE, TRAINING, load_engine("torchtitan"))
    s, h, q, kv, f = 32, 64, 64, 32, 192
    by_hand = s * (h / tp + (q + 2 * kv + f) / tp + q / tp + h + (2 * h / tp if tp > 1 else 0)) * 2  # wqkv fused
    assert one(memory.per_op_saved_bytes(ctx, arrays("selective", tp))) == pytest.approx(by_hand)


def test_a_per_op_layer_keeps_its_saved_tensors_and_one_layer_is_rebuilt_in_its_backward():
    titan = make_context(None, DENSE, TRAINING, load_engine("torchtitan"))
    la_none, la_sel = arrays("none", pp=2), arrays("selective", pp=2)
    rank0 = (np.zeros(1), np.full(1, 2.0), np.zeros(1))  # pipeline rank 0 of 2: two layers, no logits
    layer = one(memory.layer_activation_bytes(titan, la_none))
    saved = one(memory.per_op_saved_bytes(titan, la_sel))
    flight = one(memory.in_flight(titan, la_sel, np.zeros(1)))
    freed = one(memory.stage_activation_bytes(titan, la_none, *rank0)) - one(memory.stage_activation_bytes(titan, la_sel, *rank0))
    assert saved < layer and freed == pytest.approx((flight * 2 - 1) * (layer - saved))
    megatron = make_context(None, DENSE, TRAINING, load_engine("megatron-core"))  # flash: selective frees nothing
    assert one(memory.stage_activation_bytes(megatron, la_sel, *rank0)) == one(memory.stage_activation_bytes(megatron, la_none, *rank0))


def test_the_per_op_recompute_pass_is_the_two_dropped_linears_and_the_elementwise_work():
    cluster = load_cluster("dgx-h100", 1)
    ctx = make_context(cluster, DENSE, TRAINING, load_engine("torchtitan"))
    la = arrays("selective")
    s, h, q, kv, f = 32, 64, 64, 32, 192
    from plan3d.cost import compute
    gemms = compute.gemm_s(ctx, 2 * s * h * (q + f), 2)  # wo and w3 (fused wqkv, w1 and w2 are saved)
    elementwise = compute.memory_bound_s(ctx, s * h + s * (q + 2 * kv + 3 * f), ctx.elementwise_bytes)
    assert one(core.per_op_redo_s(ctx, la)) == pytest.approx(gemms + elementwise)


def test_torchtitan_selective_sits_between_none_and_full_in_memory_and_time():
    cluster, model = load_cluster("dgx-h100", 4), load_model("llama3-8b")
    est = {r: estimate(cluster, model, TrainingSpec(global_batch=64), Layout(dp=32, micro_batch=2, zero=3, recompute=r),
                       load_engine("torchtitan")) for r in ("none", "selective", "full")}
    act = {r: e.memory_bytes["activations"] for r, e in est.items()}
    assert act["full"] < act["selective"] < 0.7 * act["none"]
    assert est["none"].step_time_s < est["selective"].step_time_s < est["full"].step_time_s
