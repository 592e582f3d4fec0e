"""A flash-attention backward recomputes the scores: 2.5x the forward's attention FLOPs (five
score-sized GEMMs against two), where unfused attention keeps the softmax and pays twice."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.cost import compute, core
from plan3d.cost.arrays import layout_arrays
from plan3d.cost.context import make_context
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec


def one(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def test_the_extra_is_half_the_attention_cores_gemms_by_hand():
    cluster, model = load_cluster("dgx-h100", 1), load_model("llama3-8b")
    training = TrainingSpec(global_batch=8, seq_len=8192)
    ctx = make_context(cluster, model, training, load_engine("megatron-core"))
    la = layout_arrays(8, [2], [1], [4], [1], [1], [1], [0], [1])
    tokens_share = one(la.mb_share)
    by_hand = 0.5 * compute.gemm_s(ctx, compute.attention_work_flops(ctx, tokens_share) / 2, 2)
    assert one(core.flash_backward_extra_s(ctx, la)) == pytest.approx(by_hand)
    unfused = make_context(cluster, model, training, load_engine("megatron-lm-2021"))
    assert one(core.flash_backward_extra_s(unfused, la)) == 0.0


def test_the_extra_grows_with_the_sequence_and_lands_in_compute():
    cluster, model, engine = load_cluster("dgx-h100", 4), load_model("llama3-8b"), load_engine("megatron-core")
    layout = Layout(tp=2, dp=16, micro_batch=1, zero=1, sequence_parallel=True)
    shares = []
    for seq in (4096, 32768):
        training = TrainingSpec(global_batch=32, seq_len=seq)
        ctx = make_context(cluster, model, training, engine)
        la = layout_arrays(32, [2], [1], [16], [1], [1], [1], [0], [1])
        est = estimate(cluster, model, training, layout, engine)
        extra = one(core.flash_backward_extra_s(ctx, la)) * model.layers * est.layout["micro_batch"] * 2  # m = 2
        shares.append(extra / est.time_s["compute"])
        assert 0 < extra < est.time_s["compute"]
    assert shares[1] > 2 * shares[0]


def test_zero3_full_recompute_gathers_again_only_where_the_engine_releases_the_weights():
    """RunsAs.zero3_recompute_regathers: DeepSpeed fetches a layer's weights again for the
    recompute's forward (3 gathers per micro-batch); FSDP2 and Megatron-FSDP reuse that gather for
    the backward (2, as without recompute). With nothing hidden the ZeRO-3 time shows it."""
    cluster, model = load_cluster("dgx-a100-80g", 4), load_model("llama3-8b")
    training = TrainingSpec(global_batch=64)
    base = load_engine("megatron-core")
    def zero_comm(regathers: bool, recompute: str) -> float:
        runs_as = base.runs_as.model_copy(update={"zero3_recompute_regathers": regathers, "zero3_overlap_fraction": 0.0})
        engine = base.model_copy(update={"runs_as": runs_as})
        layout = Layout(dp=32, micro_batch=1, zero=3, recompute=recompute)
        return estimate(cluster, model, training, layout, engine).time_s["zero_comm"]
    assert zero_comm(False, "full") == pytest.approx(zero_comm(False, "none"))
    assert zero_comm(True, "none") == pytest.approx(zero_comm(False, "none"))
    assert zero_comm(True, "full") > 1.2 * zero_comm(False, "full")
    assert not base.runs_as.zero3_recompute_regathers and load_engine("deepspeed-0.19").runs_as.zero3_recompute_regathers
