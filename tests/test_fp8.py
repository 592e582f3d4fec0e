"""FP8 training (issue 16): refused where the GPU has no FP8 units, timed with the linear-layer
GEMMs at the fp8 peak (attention, logits and norms in bf16) plus the cast traffic, emitted."""
from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from cli_helpers import run_cli
from plan3d.cost import compute
from plan3d.cost.context import make_context
from plan3d.cost.estimate import estimate
from plan3d.cost.fp8 import CAST_BYTES
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError, SpecError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.training import TrainingSpec

H100 = ["-c", "dgx-h100", "--nodes", "8"]
A100 = ["-c", "dgx-a100-80g", "--nodes", "1"]
LLAMA70B_LAYOUT = Layout(tp=8, pp=1, dp=8, zero=1, sequence_parallel=True, recompute="full")


def training(precision: str, **extra) -> TrainingSpec:
    return TrainingSpec(global_batch=128, seq_len=8192, precision=precision, **extra)


def h100_step(precision: str, model: str = "llama3-70b", layout: Layout = LLAMA70B_LAYOUT, cluster=None):
    cluster = cluster or load_cluster("dgx-h100", nodes=8)
    return estimate(cluster, load_model(model), training(precision), layout)


# refusal: one rule, every command

@pytest.mark.parametrize("command", [
    ["estimate", *A100, "-m", "llama3-8b", "--dp", "8"],
    ["recommend", *A100, "-m", "llama3-8b"],
])
def test_fp8_on_an_a100_is_one_error_line_naming_the_gpu_and_bf16(capsys, command):
    code, out, err = run_cli(capsys, *command, "--precision", "fp8")
    assert code == 2
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out + err
    assert lines[0].startswith("error: gpu a100-80gb: has no FP8 tensor cores")
    assert "--precision bf16" in lines[0]


def test_check_refuses_an_fp8_job_on_an_a100(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"cluster": "dgx-a100-80g", "model": "llama3-8b",
                                   "training": {"global_batch": 64, "precision": "fp8"},
                                   "layout": {"dp": 8, "zero": 1}}))
    code, out, err = run_cli(capsys, "check", str(job))
    assert code == 2
    assert "a100-80gb: has no FP8 tensor cores" in out + err


def test_the_same_job_in_bf16_passes_the_rule(capsys):
    code, _, _ = run_cli(capsys, "estimate", *A100, "-m", "llama3-8b", "--dp", "8", "--precision", "bf16")
    assert code == 0


def test_a_gpu_spec_without_an_fp8_peak_is_refused_and_with_one_accepted():
    no_fp8 = GPUSpec(name="mi250x", memory_gib=128, peak_tflops={"bf16": 383, "fp16": 383}, hbm_tbytes_per_s=3.2)
    with pytest.raises(SpecError, match="mi250x: has no FP8 tensor cores.*--precision bf16"):
        no_fp8.require_precision("fp8")
    with pytest.raises(SpecError):
        no_fp8.peak_flops("fp8")  # no silent fall back to the bf16 peak
    no_fp8.require_precision("bf16")
    with_fp8 = no_fp8.model_copy(update={"peak_tflops": {"bf16": 383, "fp8": 766}})
    assert with_fp8.has_fp8 and with_fp8.peak_flops("fp8") == 766e12


def test_a_cpu_cluster_is_told_its_own_precision():
    with pytest.raises(SpecError, match="cpu-process: has no FP8"):
        estimate(load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=8, precision="fp8"),
                 Layout(dp=1))


# time

def test_fp8_is_faster_than_bf16_by_less_than_the_peak_ratio():
    """The fp8/bf16 peak ratio (2x) is the bound no model with bf16 attention and casts can reach;
    the linear GEMMs dominate a 70B layer, so the gain is above 1 (Hopper's fitted 0.73 caps the
    linear GEMMs at 1.46x)."""
    bf16, fp8 = h100_step("bf16"), h100_step("fp8")
    speedup = bf16.step_time_s / fp8.step_time_s
    peaks = load_cluster("dgx-h100").gpu.peak_tflops
    assert 1.1 <= speedup < 2 * load_cluster("dgx-h100").gpu.compute_efficiency.fp8_gemm_fraction < peaks["fp8"] / peaks["bf16"]


def test_only_the_linear_gemms_change_attention_and_logits_stay_bf16():
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("llama3-70b")
    bf16, fp8 = make_context(cluster, model, training("bf16")), make_context(cluster, model, training("fp8"))
    assert fp8.peak_flops == bf16.peak_flops == cluster.gpu.peak_flops("bf16")
    assert compute.attention_core_forward_s(fp8, 1, 8) == compute.attention_core_forward_s(bf16, 1, 8)
    assert compute.logits_forward_s(fp8, 1, 8) == compute.logits_forward_s(bf16, 1, 8)
    assert fp8.fp8_peak_flops == cluster.gpu.peak_flops("fp8")
    prior = cluster.gpu.compute_efficiency.fp8_gemm_fraction
    assert fp8.fp8_max_fraction == pytest.approx(bf16.gemm_max_fraction * prior)


def test_the_layer_gemms_are_fp8_linear_plus_bf16_attention_plus_a_third_of_the_casts():
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("llama3-70b")
    ctx = make_context(cluster, model, training("fp8"))
    mb, tp, tokens = 1, 8, 8192
    h, q, kv, ffn = model.hidden, ctx.q_dim, ctx.kv_dim, model.ffn_hidden_
    linear_flops = 2 * tokens * (h * (q + 2 * kv) + q * h + 3 * h * ffn) / tp  # SwiGLU: three MLP matrices
    linear = (linear_flops / (ctx.fp8_max_fraction * ctx.fp8_peak_flops)
              + 4 * ctx.gemm_half_work_flops / (ctx.gemm_max_fraction * ctx.peak_flops))
    attention = (4 * mb * tokens**2 * q / tp + 2 * ctx.gemm_half_work_flops) / (ctx.gemm_max_fraction * ctx.peak_flops)
    cast_elements = 4 * tokens * h + tokens * (2 * q + 2 * kv + ffn + 3 * ffn) / tp
    cast = cast_elements * CAST_BYTES / ctx.hbm_bytes_per_s
    assert compute.layer_gemms_s(ctx, mb, tp) == pytest.approx(linear + attention + cast / 3, rel=1e-12)


def test_16_bit_contexts_carry_no_fp8_and_keep_the_one_curve_for_all_six_gemms():
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("llama3-70b")
    for precision in ("bf16", "fp16", "fp32"):
        ctx = make_context(cluster, model, training(precision))
        assert (ctx.fp8_peak_flops, ctx.fp8_max_fraction, ctx.fp8_cast_bytes) == (0.0, 0.0, 0.0)
        flops = (compute.layer_gemm_flops(ctx, 8192) + compute.layer_attention_flops(ctx, 1)) / 8
        assert compute.layer_gemms_s(ctx, 1, 8) == compute.gemm_s(ctx, flops, compute.GEMMS_PER_LAYER)


def test_the_cast_traffic_costs_time():
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("llama3-70b")
    ctx = make_context(cluster, model, training("fp8"))
    assert compute.layer_gemms_s(replace(ctx, fp8_cast_bytes=0.0), 1, 8) < compute.layer_gemms_s(ctx, 1, 8)


def test_small_per_gpu_matrices_gain_less_from_fp8():
    """The fixed cost per kernel does not shrink with the data type: tiny GEMMs barely speed up."""
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("llama3-8b")

    def gemm_speedup(seq: int) -> float:
        bf16 = make_context(cluster, model, TrainingSpec(global_batch=8, seq_len=seq))
        fp8 = make_context(cluster, model, TrainingSpec(global_batch=8, seq_len=seq, precision="fp8"))
        return compute.layer_gemms_s(bf16, 1, 8) / compute.layer_gemms_s(fp8, 1, 8)

    assert gemm_speedup(64) < gemm_speedup(8192)
    assert 1.1 < gemm_speedup(8192) < 2 * cluster.gpu.compute_efficiency.fp8_gemm_fraction


def test_the_gpu_specs_fp8_gemm_fraction_drives_the_prediction():
    cluster = load_cluster("dgx-h100", nodes=8)
    eff = cluster.gpu.compute_efficiency
    slower_eff = eff.model_copy(update={"fp8_gemm_fraction": 0.6})
    slower_gpu = cluster.gpu.model_copy(update={"compute_efficiency": slower_eff})
    slower = cluster.model_copy(update={"gpu": slower_gpu})
    assert h100_step("fp8", cluster=slower).step_time_s > h100_step("fp8").step_time_s
    with pytest.raises(ValueError):
        type(eff).model_validate({"fp8_gemm_fraction": 0})


def test_fp8_mfu_is_counted_against_the_bf16_peak():
    est = h100_step("fp8")
    assert est.mfu == pytest.approx(est.model_tflops_per_gpu * 1e12 / load_cluster("dgx-h100").gpu.peak_flops("bf16"))


def test_the_estimate_says_where_the_fp8_efficiency_comes_from():
    """Hopper: 0.73, fitted on the published pairs; Blackwell: the 0.9 prior, said to be one."""
    warnings = h100_step("fp8").warnings
    assert any(w.startswith("fp8:") and "0.73 x the bf16" in w and "fitted on five" in w for w in warnings)
    assert not any("fp8" in w for w in h100_step("bf16").warnings)
    blackwell = h100_step("fp8", cluster=load_cluster("gb200-nvl72", nodes=16)).warnings
    assert any(w.startswith("fp8:") and "0.9 x the bf16" in w and "a prior" in w for w in blackwell)


# emitters

def fp8_plan(layout: Layout, cluster: str = "dgx-h100", nodes: int = 1):
    return build_plan(load_cluster(cluster, nodes=nodes), load_model("llama3-8b"),
                      TrainingSpec(global_batch=64, precision="fp8"), layout)


def test_megatron_gets_hybrid_delayed_fp8_and_bf16():
    text = emit_megatron(fp8_plan(Layout(tp=2, dp=4, zero=1, sequence_parallel=True))).text
    args = text.replace("\\\n", " ").split()
    at = args.index("--fp8-format")
    assert args[at:at + 4] == ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    assert "--bf16" in args


def test_deepspeed_refuses_fp8_with_the_reason_and_the_way_out():
    with pytest.raises(InfeasibleError, match="no FP8 training in its config.*--precision bf16"):
        emit_deepspeed(fp8_plan(Layout(dp=8, zero=1)))


def test_torchtitan_converts_the_layers_and_keeps_the_head():
    text = emit_torchtitan(fp8_plan(Layout(tp=2, dp=4, zero=2, sequence_parallel=True))).text
    assert "from torchtitan.components.quantization import Float8LinearConverter" in text
    assert 'Float8LinearConverter.Config(filter_fqns=["lm_head"]' in text  # through model_registry or the builder
    bf16 = build_plan(load_cluster("dgx-h100", nodes=1), load_model("llama3-8b"), TrainingSpec(global_batch=64),
                      Layout(tp=2, dp=4, zero=2, sequence_parallel=True))
    assert "Float8" not in emit_torchtitan(bf16).text


def test_every_emitter_refuses_fp8_on_an_a100():
    plan = fp8_plan(Layout(tp=2, dp=4, zero=2), cluster="dgx-a100-80g")
    for emit in (emit_megatron, emit_torchtitan):
        with pytest.raises(SpecError, match="a100-80gb"):
            emit(plan)


# memory: FP8 weight caches and FP8-saved GEMM inputs
def _memory(precision: str, layout: Layout) -> dict:
    est = h100_step(precision, layout=layout)
    return est.memory_bytes


def test_fp8_saves_the_linear_inputs_in_one_byte_and_caches_fp8_weights():
    """Against bf16 on the same layout (no recompute, tp8 with SP, ZeRO-1): activations shrink by
    one byte per element of the QKV/FC1 inputs (h / tp each, sequence-split), the projection input
    (q / tp) and the FC2 input (ffn / tp), per layer and in-flight micro-batch; buffers grow by two
    bytes per linear weight element of the rank (the FP8 weight and its transpose)."""
    model = load_model("llama3-70b")
    layout = LLAMA70B_LAYOUT.model_copy(update={"recompute": "none"})
    bf16, fp8 = _memory("bf16", layout), _memory("fp8", layout)
    tokens, tp, h = 8192, 8, model.hidden
    saved = tokens * (2 * h / tp + model.heads * model.head_dim_ / tp + model.ffn_hidden_ / tp)
    assert bf16["activations"] - fp8["activations"] == pytest.approx(model.layers * saved, rel=1e-12)
    kv = model.kv_heads_ * model.head_dim_
    linear = h * (model.heads * model.head_dim_ + 2 * kv) + model.heads * model.head_dim_ * h + 3 * h * model.ffn_hidden_
    assert fp8["buffers"] - bf16["buffers"] == pytest.approx(2 * model.layers * linear / tp, rel=1e-12)
    for term in ("weights", "gradients", "optimizer"):
        assert fp8[term] == bf16[term]  # bf16 master copies as before


def test_under_zero3_only_the_gathered_layers_have_an_fp8_cache():
    model = load_model("llama3-70b")
    layout = LLAMA70B_LAYOUT.model_copy(update={"zero": 3})
    extra = _memory("fp8", layout)["buffers"] - _memory("bf16", layout)["buffers"]
    kv = model.kv_heads_ * model.head_dim_
    q = model.heads * model.head_dim_
    linear = model.hidden * (q + 2 * kv) + q * model.hidden + 3 * model.hidden * model.ffn_hidden_
    assert extra == pytest.approx(2 * 2 * linear / 8, rel=1e-12)
