"""ZeRO-3 moves each pass's weights as several collectives per layer (runs_as.
zero3_collectives_per_layer), each paying the ring's n - 1 hops of latency (plan3d.cost.core.stage_step_s)."""
import pytest

from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster, load_engine
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

GPT = ModelSpec(name="gpt", layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
CLUSTER = load_cluster("dgx-a100-80g", nodes=2)  # dp 16 spans both nodes: the InfiniBand tier, 8 us a hop


def zero_comm(per_layer, layout=Layout(dp=16, zero=3), engine="deepspeed-0.19"):
    spec = load_engine(engine)
    spec = spec.model_copy(update={"runs_as": spec.runs_as.model_copy(
        update={"zero3_collectives_per_layer": per_layer, "zero3_overlap_fraction": 0.0})})
    return estimate(CLUSTER, GPT, TrainingSpec(global_batch=32, precision="bf16"), layout, spec).time_s["zero_comm"]


def test_each_more_collective_per_layer_pays_the_rings_latency():
    # 2 micro-batches x (forward gather + backward gather + reduce-scatter) x 3 more collectives
    # per layer x 4 layers x 15 hops x 8 us
    extra = zero_comm(4.0) - zero_comm(1.0)
    assert extra == pytest.approx(2 * 3 * 3 * 4 * 15 * 8e-6, rel=1e-6)


def test_full_recompute_gathers_once_more_per_layer():
    layout = Layout(dp=16, zero=3, recompute="full")
    extra = zero_comm(4.0, layout) - zero_comm(1.0, layout)
    assert extra == pytest.approx(2 * 4 * 3 * 4 * 15 * 8e-6, rel=1e-6)


def test_deepspeed_gathers_submodule_by_submodule_and_fsdp2_block_by_block():
    assert load_engine("deepspeed-0.19").runs_as.zero3_collectives_per_layer == 4
    assert load_engine("torchtitan").runs_as.zero3_collectives_per_layer == 1


def test_without_zero3_the_count_changes_nothing():
    assert zero_comm(4.0, Layout(dp=16, zero=1)) == zero_comm(1.0, Layout(dp=16, zero=1)) == 0.0
