"""estimate(): contract keys, topology, monotonicity, every bundled cluster x model."""
import math

import pytest

from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems
from plan3d.specs.catalog import bundled_names, load_cluster, load_model
from plan3d.specs.training import TrainingSpec

CONTRACT_KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes", "capacity_bytes",
                 "fits", "bubble_fraction", "memory_bytes", "stage_memory_bytes", "time_s", "tiers", "warnings",
                 "layout"}


def gpt175(nodes=8):
    return load_cluster("dgx-a100-80g", nodes=nodes), load_model("gpt3-175b"), TrainingSpec(global_batch=512)


def test_to_dict_has_the_contract_keys():
    cluster, model, training = gpt175()
    out = estimate(cluster, model, training, Layout(tp=8, pp=8, dp=1, recompute="full")).to_dict()
    assert CONTRACT_KEYS <= set(out)
    assert set(out["memory_bytes"]) == {"weights", "gradients", "optimizer", "activations", "buffers", "reserve"}
    assert {"compute", "recompute", "bubble", "tp_comm", "pp_comm", "dp_comm", "zero_comm"} <= set(out["time_s"])
    assert len(out["stage_memory_bytes"]) == 8
    assert out["peak_memory_bytes"] == pytest.approx(sum(out["memory_bytes"].values()))
    assert out["peak_memory_bytes"] == max(out["stage_memory_bytes"])
    assert out["step_time_s"] == pytest.approx(sum(out["time_s"].values()))
    assert out["capacity_bytes"] == pytest.approx(80 * 2**30 * (1 - training.memory_headroom_fraction))


def test_tp_spanning_nodes_is_slower_than_tp_inside_a_node():
    cluster, model, training = gpt175(nodes=2)
    inside = estimate(cluster, model, training, Layout(tp=8, pp=2, recompute="full"))
    across = estimate(cluster, model, training, Layout(tp=8, pp=2, recompute="full", order="pp-cp-ep-dp-tp"))
    assert inside.tiers["tp"] == cluster.tiers()[0].name and across.tiers["tp"] == cluster.tiers()[1].name
    assert across.time_s["tp_comm"] > inside.time_s["tp_comm"] and across.step_time_s > inside.step_time_s
    assert any("TP group spans" in w for w in across.warnings)


def test_more_recompute_never_costs_memory():
    cluster, model, training = gpt175()
    peaks = [estimate(cluster, model, training, Layout(tp=8, pp=8, micro_batch=2, recompute=r)).peak_memory_bytes
             for r in ("none", "selective", "full")]
    assert peaks[0] >= peaks[1] >= peaks[2]


def test_sequence_parallel_and_interleaving_move_memory_the_right_way():
    cluster, model, training = gpt175()
    plain = estimate(cluster, model, training, Layout(tp=8, pp=8, micro_batch=1))
    sp = estimate(cluster, model, training, Layout(tp=8, pp=8, micro_batch=1, sequence_parallel=True))
    assert sp.memory_bytes["activations"] < plain.memory_bytes["activations"]
    inter = estimate(cluster, model, training, Layout(tp=8, pp=8, micro_batch=1, vpp=2))
    assert inter.memory_bytes["activations"] > plain.memory_bytes["activations"]
    assert inter.bubble_fraction < plain.bubble_fraction


def test_layout_smaller_than_cluster_uses_first_gpus():
    cluster, model, training = gpt175(nodes=16)
    est = estimate(cluster, model, training, Layout(tp=8, pp=8, dp=1))
    assert any("64 of the cluster's 128" in w for w in est.warnings)


def test_impossible_layout_raises_with_valid_choices():
    cluster, model, training = gpt175()
    with pytest.raises(LayoutError, match="valid tp"):
        estimate(cluster, model, training, Layout(tp=5, pp=1, dp=1))


def some_valid_layout(cluster, model, training):
    for tp in (8, 4, 2, 1, 16):
        for pp in (1, 2, 4, 8, 16, 32):
            for dp in sorted({cluster.world_size // (tp * pp), 1}, reverse=True):
                if dp < 1:
                    continue
                layout = Layout(tp=tp, pp=pp, dp=dp, recompute="full")
                if not layout_problems(layout, model, training, cluster.world_size):
                    return layout
    raise AssertionError("no valid layout")


@pytest.mark.parametrize("cluster_name", bundled_names("cluster"))
@pytest.mark.parametrize("model_name", bundled_names("model"))
def test_every_bundled_cluster_and_model(cluster_name, model_name):
    cluster, model = load_cluster(cluster_name), load_model(model_name)
    training = TrainingSpec(global_batch=model.default_global_batch or 64)
    est = estimate(cluster, model, training, some_valid_layout(cluster, model, training))
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert 0 < est.mfu < 1 and est.peak_memory_bytes > 0


def test_uneven_stages_are_paced_by_the_slowest():
    cluster, model, training = gpt175()
    even = estimate(cluster, model, training, Layout(tp=8, pp=2, dp=4, recompute="full"))
    uneven = estimate(cluster, model, training, Layout(tp=8, pp=2, dp=4, recompute="full", pp_layers=(40, 56)))
    assert uneven.step_time_s > even.step_time_s
    assert uneven.stage_memory_bytes[1] > even.stage_memory_bytes[1]


def test_fits_compares_peak_with_usable_capacity():
    cluster, model, training = gpt175()
    est = estimate(cluster, model, training, Layout(tp=8, pp=1, dp=8))
    assert not est.fits and est.peak_memory_bytes > est.capacity_bytes
    assert any("does not fit" in w for w in est.warnings)
