"""Per-collective tier costs, host/compute serialisation on CPUs, vocabulary-parallel and
step-sync collectives (plan3d/cost/core.py, comm.py, compute.py)."""
from __future__ import annotations

import pytest

from plan3d.cost.comm import layout_links
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.training import TrainingSpec

TRAINING = TrainingSpec(global_batch=16, precision="fp32")


def cpu_cluster(collectives=None, host_overlap=False, latency_us=1000.0):
    data = load_cluster("local-cpu").model_dump()
    data["network"][0].update(latency_us=latency_us, efficiency=0.5, collectives=collectives or {})
    data["gpu"]["compute_efficiency"]["host_overlap"] = host_overlap
    return ClusterSpec.model_validate(data)


def step(cluster, **layout):
    return estimate(cluster, load_model("tiny-gpt"), TRAINING, Layout(**layout))


def test_a_tier_resolves_per_collective_costs_and_falls_back_to_its_own():
    cluster = cpu_cluster({"reduce_scatter": {"latency_us": 3000, "efficiency": 0.125}})
    tier = cluster.tiers()[0]
    assert tier.cost("reduce_scatter") == pytest.approx((1e9 * 0.125, 3e-3))
    assert tier.cost("all_gather") == pytest.approx((1e9 * 0.5, 1e-3))  # not given: the tier's own
    links = layout_links(2, 1, 4, "tp-cp-ep-dp-pp", tuple(cluster.tiers()), 8)
    assert links["tp"].cost("reduce_scatter")[1] == pytest.approx(3e-3)
    assert links["tp"].latency_s == pytest.approx(1e-3)


def test_unknown_collective_kind_is_rejected():
    with pytest.raises(Exception, match="broadcast|all_reduce"):
        cpu_cluster({"broadcast": {"latency_us": 1, "efficiency": 0.5}})


def test_a_slow_reduce_scatter_slows_sequence_parallel_and_zero2_only():
    base, slow_rs = cpu_cluster(), cpu_cluster({"reduce_scatter": {"latency_us": 5000, "efficiency": 0.5}})
    sp = dict(tp=2, pp=1, dp=4, micro_batch=2, sequence_parallel=True)
    plain = dict(tp=2, pp=1, dp=4, micro_batch=2)
    zero2, zero0 = dict(tp=1, pp=1, dp=8, micro_batch=2, zero=2), dict(tp=1, pp=1, dp=8, micro_batch=2)
    # per pass each sublayer pays 4 more ms of reduce-scatter latency (1 hop each)
    assert step(slow_rs, **sp).time_s["tp_comm"] > step(base, **sp).time_s["tp_comm"] + 0.05
    assert step(slow_rs, **plain).time_s["tp_comm"] == pytest.approx(step(base, **plain).time_s["tp_comm"])
    assert step(slow_rs, **zero2).time_s["dp_comm"] - step(base, **zero2).time_s["dp_comm"] == pytest.approx(7 * 4e-3)
    assert step(slow_rs, **zero0).step_time_s == pytest.approx(step(base, **zero0).step_time_s)


def test_pipeline_sends_use_the_p2p_cost():
    base, slow = cpu_cluster(), cpu_cluster({"p2p": {"latency_us": 3000, "efficiency": 0.5}})
    layout = dict(tp=1, pp=2, dp=4, micro_batch=2)
    m = 16 // 4 // 2  # micro-batches; one forward and one backward send each (v = 1)
    assert step(slow, **layout).time_s["pp_comm"] - step(base, **layout).time_s["pp_comm"] == pytest.approx(
        m * 2 * 2e-3)


def test_on_a_cpu_host_and_compute_times_add():
    serial, overlapped = cpu_cluster(host_overlap=False), cpu_cluster(host_overlap=True)
    s, o = step(serial, tp=1, pp=1, dp=8, micro_batch=2), step(overlapped, tp=1, pp=1, dp=8, micro_batch=2)
    host = serial.gpu.compute_efficiency.layer_overhead_s
    layers, micro_batches = 8, 1
    assert s.time_s["overhead"] == pytest.approx(3 * host * layers * micro_batches)  # fwd 1 + bwd 2 per layer
    assert s.step_time_s > o.step_time_s


def test_vocab_parallel_ends_add_tp_traffic_on_first_and_last_stage_only():
    cluster = cpu_cluster()
    est = step(cluster, tp=2, pp=2, dp=2, micro_batch=2)
    tiers = tuple(cluster.tiers())
    bw, lat = layout_links(2, 2, 2, "tp-cp-ep-dp-pp", tiers, 8)["tp"].cost("all_reduce")
    model = load_model("tiny-gpt")
    boundary = 2 * model.seq_len * model.hidden * 4
    exchange = 2 * 1 / 2 * boundary / bw + 2 * lat
    loss = 3 * (2 * 1 / 2 * 2 * model.seq_len * 4 / bw + 2 * lat)
    per_layer = 2 * 2 * exchange  # two exchanges per pass, forward and backward
    m = 16 // 2 // 2
    # the last stage is the slowest (logits): its TP traffic = layers' + boundary + loss
    assert est.time_s["tp_comm"] == pytest.approx(m * (4 * per_layer + exchange + loss), rel=1e-9)


def test_step_syncs_are_two_tree_all_reduces_over_all_ranks():
    cpu = cpu_cluster()
    alone = step(cpu, tp=1, pp=1, dp=8, micro_batch=2)
    bw, lat = 0.5e9, 1e-3
    params = alone.memory_bytes["weights"]
    reduce = 2 * 7 / 8 * params / bw + 14 * lat  # ZeRO-0 gradient all-reduce over dp 8 (ring)
    assert alone.time_s["dp_comm"] == pytest.approx(reduce + 2 * 2 * 3 * lat, rel=1e-6)  # + two 6-hop trees
    gpus = load_cluster("dgx-h100")
    training = TrainingSpec(global_batch=1024)
    latency = max(t.latency_s for t in gpus.tiers())
    no_dp = estimate(gpus, load_model("gpt3-175b"), training, Layout(tp=8, pp=16, dp=1, micro_batch=1))
    # the tied-embedding all-reduce hides behind the backward (bucketed); the syncs come after it
    assert no_dp.time_s["dp_comm"] == pytest.approx(2 * 2 * 7 * latency, rel=1e-9)


def test_ranks_sharing_cores_reuse_the_bubble():
    from plan3d.cost.pipeline import pipeline_s
    import numpy as np

    stages, weights = np.array([[1.0], [1.0]]), np.array([[1.0], [1.0]])  # two equal stages, 1 s each
    m = 2  # 1F1B: (m + p - 1) t = 3 s, bubble 1 s, busy fraction 2/3
    assert pipeline_s(stages, weights, m, 1) == pytest.approx((3.0, 1.0))
    assert pipeline_s(stages, weights, m, 1, core_share=0.25) == pytest.approx((2.0, 0.0))  # bubble free
    total, bubble = pipeline_s(stages, weights, m, 1, core_share=0.9)  # a rank can only take one core
    assert total == pytest.approx(2.7) and bubble == pytest.approx(0.7)
    base = cpu_cluster().model_copy(update={"cpu_cores_per_node": None})  # every rank owns a core
    shared = cpu_cluster().model_copy(update={"cpu_cores_per_node": 2})
    pp = dict(tp=1, pp=2, dp=4, micro_batch=2)
    assert step(shared, **pp).time_s["bubble"] < step(base, **pp).time_s["bubble"]
    flat = dict(tp=1, pp=1, dp=8, micro_batch=2)
    assert step(shared, **flat).step_time_s == pytest.approx(step(base, **flat).step_time_s)  # no bubble, no change
    two = dict(tp=1, pp=2, dp=1, micro_batch=2)  # two ranks on two cores: each owns one, nothing to reuse
    assert step(base, **two).time_s["bubble"] > 0
    assert step(shared, **two).time_s["bubble"] == pytest.approx(step(base, **two).time_s["bubble"])
