"""Engine profiles in the cost model: what each engine can run, and each new term on a case
computed by hand (plan3d/specs/engine.py, plan3d/cost/context.py, core.py, comm.py, trust.py)."""
from __future__ import annotations

import pytest

from plan3d.cost.comm import layout_links
from plan3d.cost.context import make_context
from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.specs.catalog import bundled_names, load_cluster, load_engine
from plan3d.specs.engine import EngineSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

GPT = ModelSpec(name="gpt-4l", layers=4, hidden=1024, heads=16, vocab=32000, seq_len=1024)
LLAMA = GPT.model_copy(update={"name": "llama-4l", "activation": "swiglu", "norm": "rmsnorm", "position": "rope",
                               "bias": False})
TRAINING = TrainingSpec(global_batch=64)


def engine(name: str, **updates) -> EngineSpec:
    base = load_engine(name)
    for section, values in updates.items():
        updates[section] = getattr(base, section).model_copy(update=values)
    return base.model_copy(update=updates)


@pytest.mark.parametrize("name", bundled_names("engine"))
def test_every_bundled_engine_estimates_a_layout_it_can_run(name):
    eng = load_engine(name)
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, zero=eng.can_run.zero_with_pp[0],
                    recompute=eng.can_run.recompute[0], order=eng.can_run.orders[0],
                    sequence_parallel=eng.can_run.sequence_parallel_required)
    if not eng.can_run.tensor_parallel or not eng.can_run.tensor_parallel_with_pp:
        layout = layout.model_copy(update={"tp": 1, "dp": 4, "sequence_parallel": False})
    model = LLAMA if eng.model_problems(GPT) else GPT  # torchtitan builds Llama-shaped models only
    assert not eng.model_problems(model)
    est = estimate(load_cluster("dgx-h100", nodes=1), model, TRAINING, layout, eng)
    assert est.engine == name and est.step_time_s > 0


@pytest.mark.parametrize("name, layout, words", [
    ("megatron-deepspeed", Layout(tp=2, pp=2, dp=2, zero=2), "ZeRO-2 with pipeline"),
    ("megatron-deepspeed", Layout(tp=2, pp=2, dp=2, vpp=2), "interleaved"),
    ("megatron-deepspeed", Layout(tp=2, pp=2, dp=2, sequence_parallel=True), "sequence parallelism"),
    ("megatron-core", Layout(tp=2, pp=2, dp=2, zero=3), "ZeRO-3 with pipeline"),
    ("deepspeed-0.19", Layout(tp=2, pp=2, dp=2, zero=1), "tensor parallelism only without a pipeline"),
    ("megatron-lm-2021", Layout(tp=2, pp=1, dp=4, zero=1), "ZeRO-1 without pipeline"),
    ("deepspeed", Layout(tp=2, pp=1, dp=4), "no tensor parallelism"),
    ("torchtitan", Layout(tp=2, pp=2, dp=2, zero=1), "ZeRO-1 with pipeline"),
    ("torchtitan", Layout(tp=1, pp=1, dp=8, zero=1), "ZeRO-1"),
    ("torchtitan", Layout(tp=1, pp=2, dp=4, order="tp-cp-ep-pp-dp"), "places ranks only"),
])
def test_an_engine_refuses_what_it_cannot_run_naming_itself(name, layout, words):
    with pytest.raises(LayoutError, match=name) as err:
        estimate(load_cluster("dgx-h100", nodes=1), GPT, TRAINING, layout, load_engine(name))
    assert words in str(err.value)


def test_megatron_deepspeed_splits_bloom_like_layers_counting_embedding_and_head():
    eng = load_engine("megatron-deepspeed")
    # 70 layers + 2 on 12 stages: 6 units each, the end stages give one to the embedding / head
    assert eng.default_split(70, 12, 1) == (5,) + (6,) * 10 + (5,)
    assert eng.default_split(70, 24, 1) == (2,) + (3,) * 22 + (2,)
    assert eng.default_split(72, 12, 1) is None  # even: no uneven split
    # Megatron-Core takes per-stage counts: the balanced split, extra layers to the middle stages first
    assert load_engine("megatron-core").default_split(70, 12, 1) == (5,) + (6,) * 10 + (5,)
    assert load_engine("megatron-core").default_split(126, 16, 1) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B
    assert load_engine("megatron-core").default_split(32, 6, 1) == (5, 6, 6, 5, 5, 5)
    bloomish = GPT.model_copy(update={"layers": 70})
    est = estimate(load_cluster("dgx-a100-80g", nodes=12), bloomish, TrainingSpec(global_batch=96),
                   Layout(tp=8, pp=12, dp=1), eng)
    assert est.layout["pp_layers"] == [5] + [6] * 10 + [5]
    assert not any("does not divide" in w for w in est.warnings)  # the engine's own partition: nothing to say
    core = estimate(load_cluster("dgx-a100-80g", nodes=12), bloomish, TrainingSpec(global_batch=96),
                    Layout(tp=8, pp=12, dp=1), load_engine("megatron-core"))
    assert core.layout["pp_layers"] == [5] + [6] * 10 + [5]
    assert any("does not divide 70 layers: split as 5, 6 x 10, 5" in w for w in core.warnings)
    with pytest.raises(LayoutError, match="does not divide 70 layers"):  # an engine that splits evenly only
        estimate(load_cluster("dgx-a100-80g", nodes=12), bloomish, TrainingSpec(global_batch=96),
                 Layout(tp=8, pp=12, dp=1), load_engine("megatron-lm-2021"))


def test_engine_software_values_replace_the_gpus_and_the_runtime_keeps_them():
    cluster = load_cluster("dgx-a100-80g")
    gpu = cluster.gpu.compute_efficiency
    ctx = make_context(cluster, GPT, TRAINING, load_engine("megatron-lm-2021"))
    eng = load_engine("megatron-lm-2021").efficiency
    assert ctx.attention_score_bytes == eng.attention_score_bytes and ctx.layer_overhead_s == eng.layer_overhead_s
    assert ctx.dp_overlap_fraction == 0.0  # gradients reduced after the backward
    flash = make_context(cluster, GPT, TRAINING, load_engine("megatron-core"))
    assert flash.attention_score_bytes == 0.0
    own = make_context(cluster, GPT, TRAINING, load_engine("plan3d-runtime"))
    assert (own.layer_overhead_s, own.elementwise_bytes, own.dp_overlap_fraction) == (
        gpu.layer_overhead_s, gpu.elementwise_bytes, gpu.dp_overlap_fraction)


def test_gemm_efficiency_scale_multiplies_the_gemm_ceiling():
    cluster = load_cluster("dgx-a100-80g")
    half = engine("megatron-core", efficiency={"gemm_efficiency_scale": 0.5})
    ceiling = cluster.gpu.compute_efficiency.max_fraction
    assert make_context(cluster, GPT, TRAINING, half).gemm_max_fraction == pytest.approx(ceiling / 2)
    assert make_context(cluster, GPT, TRAINING).gemm_max_fraction == pytest.approx(ceiling)  # no engine


def test_tp_overlap_hides_that_share_of_the_tp_collectives():
    cluster = load_cluster("dgx-h100", nodes=1)
    layout = Layout(tp=8, pp=1, dp=1, micro_batch=1, sequence_parallel=True)

    def tp_comm(fraction):
        return estimate(cluster, GPT, TRAINING, layout, engine("megatron-core", runs_as={"tp_overlap_fraction": fraction}))

    blocking, hidden, all_hidden = tp_comm(0.0), tp_comm(0.75), tp_comm(1.0)
    # fully overlapped, only the vocabulary-parallel ends (embedding, output layer, loss) remain
    ends = all_hidden.time_s["tp_comm"]
    assert 0 < ends < blocking.time_s["tp_comm"]
    assert hidden.time_s["tp_comm"] == pytest.approx(ends + 0.25 * (blocking.time_s["tp_comm"] - ends))
    assert hidden.step_time_s < blocking.step_time_s


def test_zero3_per_gpu_nic_moves_the_bytes_at_one_nic_share_not_the_nodes_rings():
    cluster = load_cluster("dgx-a100-80g", nodes=4)
    tiers = tuple(cluster.tiers())
    links = layout_links(1, 1, 32, "tp-cp-ep-dp-pp", tiers, 8)
    nic = 200e9 / 8 * 8 / 8 * tiers[1].efficiency  # 8 x 200 Gbit/s per node, per GPU
    assert links["dp_nic"].cost("all_gather")[0] == pytest.approx(nic)
    assert links["dp"].cost("all_gather")[0] == pytest.approx(min(8 * nic, tiers[0].effective_bytes_per_s))
    layout = Layout(tp=1, pp=1, dp=32, micro_batch=1, zero=3)
    ring = engine("deepspeed", runs_as={"zero3_collectives": "ring", "zero3_overlap_fraction": 0.0})
    per_nic = engine("deepspeed", runs_as={"zero3_collectives": "per-gpu-nic", "zero3_overlap_fraction": 0.0})
    training = TrainingSpec(global_batch=32, fp32_grad_accum=False)
    slow = estimate(cluster, GPT, training, layout, per_nic).time_s["zero_comm"]
    fast = estimate(cluster, GPT, training, layout, ring).time_s["zero_comm"]
    # bandwidth-bound: the ratio of the two bandwidths (latency terms are equal)
    assert slow > 3 * fast


def test_zero3_overlap_fraction_hides_gathers_behind_compute():
    cluster = load_cluster("dgx-a100-80g", nodes=4)
    layout = Layout(tp=1, pp=1, dp=32, micro_batch=2, zero=3)
    none = estimate(cluster, GPT, TRAINING, layout, engine("deepspeed", runs_as={"zero3_overlap_fraction": 0.0}))
    all_ = estimate(cluster, GPT, TRAINING, layout, engine("deepspeed", runs_as={"zero3_overlap_fraction": 1.0}))
    compute = none.time_s["compute"] + none.time_s["recompute"]
    assert all_.time_s["zero_comm"] == pytest.approx(max(none.time_s["zero_comm"] - compute, 0.0))


def test_provenance_names_fitted_values_and_flags_an_uncalibrated_gpu():
    layout = Layout(tp=8, pp=1, dp=1)
    a100 = estimate(load_cluster("dgx-a100-80g", nodes=1), GPT, TRAINING, layout, load_engine("megatron-core"))
    assert any(line.startswith("a100-80gb: GEMM efficiency fitted on") for line in a100.provenance)
    assert any(line.startswith("megatron-core:") for line in a100.provenance)
    mi300 = estimate(load_cluster("mi300x", nodes=1), GPT, TRAINING, layout, load_engine("megatron-core"))
    assert any("not calibrated" in line for line in mi300.provenance)
    assert any("no fitted efficiency values" in w for w in mi300.warnings)
    fp8 = estimate(load_cluster("dgx-h100", nodes=1), GPT, TrainingSpec(global_batch=64, precision="fp8"), layout,
                   load_engine("megatron-core"))
    assert any(w.startswith("fp8:") and "fitted on five published FP8/BF16 speed-ups" in w for w in fp8.warnings)


def test_no_engine_keeps_the_clusters_own_values():
    cluster = load_cluster("vtrain-a100")
    ctx = make_context(cluster, GPT, TRAINING)
    assert ctx.attention_score_bytes == cluster.gpu.compute_efficiency.attention_score_bytes > 0
    assert ctx.zero3_overlap_fraction is None and not ctx.zero3_per_gpu_nic and ctx.tp_overlap_fraction == 0.0


def test_a_zero_stage_no_calibration_run_had_is_flagged():
    cluster, layout = load_cluster("dgx-h100", nodes=4), dict(tp=8, pp=1, dp=4, micro_batch=1, sequence_parallel=True)
    zero1 = estimate(cluster, GPT, TRAINING, Layout(zero=1, **layout), load_engine("megatron-core"))
    zero3 = estimate(cluster, GPT, TRAINING, Layout(zero=3, **layout), load_engine("megatron-core"))
    assert not any("ZeRO-" in w for w in zero1.warnings)
    assert any("no calibration run of megatron-core with ZeRO-3" in w for w in zero3.warnings)


def test_param_gather_overlap_hides_the_zero1_all_gather_behind_a_forward():
    cluster, training = load_cluster("dgx-h100", nodes=4), TrainingSpec(global_batch=256)
    # micro-batch 2: the backward (4.8 x params / bandwidth) outlasts the fp32 reduce-scatter (4x) and half
    # of it the bf16 all-gather (2x), but not both together (6x)
    layout = Layout(tp=1, pp=1, dp=32, micro_batch=2, zero=1)

    def dp_comm(overlap, param_gather):
        eng = engine("megatron-core", efficiency={"dp_overlap_fraction": overlap},
                     runs_as={"param_gather_overlap": param_gather})
        return estimate(cluster, GPT, training, layout, eng).time_s["dp_comm"]

    # nothing overlapped: the same exposed time either way (reduce-scatter + all-gather + syncs)
    assert dp_comm(0.0, True) == pytest.approx(dp_comm(0.0, False))
    syncs = dp_comm(0.0, True) - _zero1_comm_s(cluster, layout, training)
    assert 0 < syncs < 1e-3
    # the backward hides the reduce-scatter and the forward the all-gather: only the syncs stay;
    # without the param-gather overlap both must fit behind the one backward, and do not
    assert dp_comm(1.0, True) == pytest.approx(syncs, rel=1e-6)
    assert dp_comm(1.0, False) > syncs * 1.5


def _zero1_comm_s(cluster, layout, training):
    """Reduce-scatter of the fp32 gradients + all-gather of the bf16 weights over dp (ring formulas)."""
    from plan3d.cost.comm import all_gather_s
    params = estimate(cluster, GPT, training, layout, load_engine("megatron-core")).memory_bytes["weights"] / 2
    link = layout_links(1, 1, 32, layout.order, tuple(cluster.tiers()), 8)["dp"]
    return all_gather_s(params * 4, 32, *link.cost("reduce_scatter")) + all_gather_s(params * 2, 32, *link.cost("all_gather"))


def test_an_engine_file_with_a_bad_order_is_a_spec_error_naming_the_field(tmp_path):
    from plan3d.errors import SpecError
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ncan_run:\n  orders: [tp-dp-xx]\n")
    with pytest.raises(SpecError, match="can_run.orders.*unknown axis 'xx'"):
        load_engine(str(path))
