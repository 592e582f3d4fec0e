"""Memory as each engine allocates it (issue 31): every engine term on a case computed by hand.

The model is a small GPT (h 64, 4 heads, 4 layers, GELU 4h, biases, learned positions, vocab 128,
seq 32): one layer holds 12h^2 + 13h = 49,984 parameters.
"""
import json

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import load_cluster, load_engine
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

GPT = ModelSpec(name="gpt", layers=4, hidden=64, heads=4, vocab=128, seq_len=32, dropout=0.1)
LLAMA = GPT.model_copy(update={"name": "llama", "activation": "swiglu", "norm": "rmsnorm", "position": "rope",
                               "bias": False})  # torchtitan 0.3 builds Llama-shaped models only


def model_for(spec):
    return LLAMA if spec.model_problems(GPT) else GPT
LAYER_PARAMS = 12 * 64 * 64 + 13 * 64
CLUSTER = load_cluster("dgx-a100-80g", nodes=2)
GIB = 2**30


def run(engine, layout, precision="bf16", fp32_grads=None, model=None, global_batch=64, **runs_as):
    spec = load_engine(engine)
    model = model or model_for(spec)
    if runs_as:
        spec = spec.model_copy(update={"runs_as": spec.runs_as.model_copy(update=runs_as)})
    training = TrainingSpec(global_batch=global_batch, precision=precision, fp32_grad_accum=fp32_grads)
    return estimate(CLUSTER, model, training, layout, spec)


def params_of(est) -> float:
    """Parameters on the most loaded rank, from its 16-bit weights (2 bytes each, no ZeRO-3)."""
    return est.memory_bytes["weights"] / 2


@pytest.mark.parametrize("engine,precision,fp32_grads,per_param,label", [
    ("megatron-core", "bf16", None, 4, "fp32"),       # bf16 forces --accumulate-allreduce-grads-in-fp32
    ("megatron-core", "fp16", None, 2, "fp16"),       # fp16 keeps fp16 main grads
    ("megatron-core", "bf16", False, 2, "bf16"),      # --grad-reduce-in-bf16
    ("megatron-core", "fp16", True, 4, "fp32"),       # --accumulate-allreduce-grads-in-fp32
    ("torchtitan", "bf16", None, 4, "fp32"),          # FSDP2 reduce_dtype float32
    ("megatron-deepspeed", "bf16", None, 6, "fp32 + bf16 .grad"),  # BF16_Optimizer: fp32 buffer + bf16 .grad
    ("megatron-deepspeed", "fp16", None, 2, "fp16"),  # DeepSpeed's fp16 ZeRO optimizer
])
def test_gradient_buffer_is_the_engines(engine, precision, fp32_grads, per_param, label):
    est = run(engine, Layout(dp=4, zero=0 if engine == "torchtitan" else 1), precision, fp32_grads)
    assert est.memory_bytes["gradients"] == pytest.approx(params_of(est) * per_param)
    assert est.grad_dtype == label


def test_sixteen_bit_gradients_cost_an_fp32_copy_at_the_step():
    """fp16 gradients: the fp32 optimizer step reads an fp32 copy of its shard, 4 bytes per sharded
    parameter (Megatron main_grad.float(), DeepSpeed's fp32 grad partition); fp32 grads: none."""
    half = run("megatron-core", Layout(dp=4, zero=1), "fp16")
    full = run("megatron-core", Layout(dp=4, zero=1), "fp16", fp32_grads=True)
    assert half.memory_bytes["buffers"] - full.memory_bytes["buffers"] == pytest.approx(4 * params_of(half) / 4)


@pytest.mark.parametrize("engine,zero0_bytes", [("megatron-deepspeed", 8), ("deepspeed", 8), ("megatron-core", 4)])
def test_without_zero_the_fp16_step_holds_what_the_engines_optimizer_copies(engine, zero0_bytes):
    """ZeRO-0, fp16: DeepSpeed's FP16_Optimizer casts every .grad to fp32 and then flattens the list
    (8 bytes per parameter alive at once); Megatron's Float16Optimizer one fp32 copy (4). ZeRO-1
    over one rank casts its flat partition once (4): the configured stage counts, not dp."""
    layout = Layout(dp=1, zero=0, recompute="full")
    no_bucket = {"reduce_bucket_elements": 0.0}  # its dtype would follow the gradients'
    zero0 = run(engine, layout, "fp16", **no_bucket)
    zero1 = run(engine, layout.model_copy(update={"zero": 1}), "fp16", **no_bucket)
    none = run(engine, layout, "fp16", fp32_grads=True, **no_bucket)  # fp32 gradients: no cast at all
    assert zero0.memory_bytes["buffers"] - none.memory_bytes["buffers"] == pytest.approx(zero0_bytes * params_of(zero0))
    assert zero1.memory_bytes["buffers"] - none.memory_bytes["buffers"] == pytest.approx(4 * params_of(zero1))


def test_deepspeed_reduces_through_a_bucket_of_its_gradients():
    """reduce_bucket_elements in the gradient dtype, at most the rank's gradients (fp32 with bf16)."""
    layout = Layout(pp=2, dp=4, zero=1, recompute="full")
    bucket = run("megatron-deepspeed", layout)
    none = run("megatron-deepspeed", layout, reduce_bucket_elements=0.0)
    small = run("megatron-deepspeed", layout, reduce_bucket_elements=1000.0)
    assert bucket.memory_bytes["buffers"] - none.memory_bytes["buffers"] == pytest.approx(params_of(bucket) * 4)
    assert small.memory_bytes["buffers"] - none.memory_bytes["buffers"] == pytest.approx(1000 * 4)


def test_deepspeed_keeps_each_stage_output_until_its_backward():
    """pp 2, tp 2, micro-batch 2: stage 0 holds 2 micro-batches in flight, each output s*B*h/tp in bf16."""
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=2, zero=1, recompute="full")
    kept = run("megatron-deepspeed", layout)
    freed = run("megatron-deepspeed", layout, pipeline_outputs_kept=False)
    assert kept.stage_memory_bytes[0] - freed.stage_memory_bytes[0] == pytest.approx(
        2 * (32 * 2 * 64 / 2 * 2) * (1 + 0.23), rel=1e-9)  # the reserve row adds its allocator share
    assert kept.stage_memory_bytes[1] == pytest.approx(freed.stage_memory_bytes[1])  # the last stage sends nothing


def test_deepspeed_zero3_gathers_at_most_its_live_parameters():
    """Two gathered layers (2 * 49,984 * 2 bytes) unless stage3_max_live_parameters is smaller."""
    layout = Layout(dp=16, zero=3)
    whole = run("deepspeed", layout, zero3_live_params=0.0)
    capped = run("deepspeed", layout, zero3_live_params=100.0)
    assert whole.memory_bytes["buffers"] - capped.memory_bytes["buffers"] == pytest.approx(2 * LAYER_PARAMS * 2 - 200)


def test_the_reserve_row_is_the_engines_fitted_reserve_and_allocator_share():
    est = run("megatron-deepspeed", Layout(pp=2, dp=4, zero=1, recompute="full"))
    spec = load_engine("megatron-deepspeed").efficiency
    m = est.memory_bytes
    assert m["reserve"] == pytest.approx(spec.reserved_memory_gib * GIB
                                         + spec.allocator_overhead_fraction * (m["activations"] + m["buffers"]))
    assert run("megatron-core", Layout(dp=4, zero=1)).memory_bytes["reserve"] == pytest.approx(2 * GIB)  # GPU default


def test_the_last_stage_holds_the_engines_logit_bytes():
    """Megatron: bf16 logits + the fp32 copy its loss saves, 6 bytes per element of s*B*V/tp."""
    layout = Layout(tp=2, pp=2, dp=2, zero=1)
    six = run("megatron-core", layout)
    four = run("megatron-core", layout, logit_bytes=4.0)
    assert six.stage_memory_bytes[1] - four.stage_memory_bytes[1] == pytest.approx(32 * 1 * 128 / 2 * 2)
    assert six.stage_memory_bytes[0] == pytest.approx(four.stage_memory_bytes[0])


def test_full_recompute_holds_the_larger_of_logits_and_the_recomputed_layer():
    """The loss's backward frees the logits before the first layer is recomputed: under full
    recompute the last stage holds max(logits, one layer's working set) beside its checkpoints;
    without recompute every layer's activations are still live when the logits are made."""
    logits = 32 * 128 / 2  # s * B * V / tp elements of one micro-batch
    def last(recompute, logit_bytes):
        est = run("megatron-core", Layout(tp=2, pp=2, dp=2, zero=1, recompute=recompute), logit_bytes=logit_bytes)
        return est.stage_memory_bytes[1]
    assert last("none", 2.0) - last("none", 1.0) == pytest.approx(logits)
    assert last("full", 2.0) == pytest.approx(last("full", 1.0))  # both below the layer's working set
    grown = last("full", 400.0) - last("full", 1.0)
    assert 0 < grown < 399 * logits  # the working set it replaces is no longer added


def test_torchtitan_keeps_fsdp_states_unsharded_under_pipelining():
    """pp > 1: reshard_after_forward off and gradient sync on the last backward only: the stage's
    bf16 weights whole, an unsharded fp32 gradient beside the sharded one; pp 1 shards both."""
    from plan3d.cost.memory import model_state_bytes

    titan, training = load_engine("torchtitan"), TrainingSpec(global_batch=64)
    params = 2 * LAYER_PARAMS + 128 * 64 + 32 * 64  # stage 0 of pp 2: two layers, embedding, learned positions
    piped = model_state_bytes(GPT, training, Layout(pp=2, dp=4, zero=3), 0, titan)
    assert piped["weights"] == pytest.approx(params * 2)
    assert piped["gradients"] == pytest.approx(params * 4 + params * 4 / 4)
    assert piped["optimizer"] == pytest.approx(params * 12 / 4)
    off = titan.model_copy(update={"runs_as": titan.runs_as.model_copy(update={"fsdp_unsharded_with_pp": False})})
    sharded = model_state_bytes(GPT, training, Layout(pp=2, dp=4, zero=3), 0, off)
    assert (sharded["weights"], sharded["gradients"]) == pytest.approx((params * 2 / 4, params * 4 / 4))
    flat = model_state_bytes(GPT, training, Layout(dp=8, zero=3), 0, titan)
    whole = 4 * LAYER_PARAMS + 128 * 64 + 32 * 64 + 2 * 64 + 128 * 64  # + final norm and untied head
    assert flat["weights"] == pytest.approx(whole * 2 / 8)


def test_megatron_reads_zero2_with_a_pipeline_as_its_distributed_optimizer():
    two = run("megatron-core", Layout(pp=2, dp=4, zero=2))
    one = run("megatron-core", Layout(pp=2, dp=4, zero=1))
    assert two.layout["zero"] == 1 and two.peak_memory_bytes == pytest.approx(one.peak_memory_bytes)
    assert any("distributed optimizer" in w for w in two.warnings)
    assert not any("distributed optimizer" in w for w in run("megatron-core", Layout(dp=8, zero=2)).warnings)


@pytest.mark.parametrize("engine", ["megatron-deepspeed", "torchtitan", "deepspeed", "megatron-core"])
def test_batch_equals_scalar_for_each_engines_memory(engine):
    """estimate_batch() and estimate() share every engine term (pipeline outputs, buckets, FSDP under pp)."""
    spec = load_engine(engine)
    model = model_for(spec)
    training = TrainingSpec(global_batch=64)
    layouts = []
    for tp, pp, zero, recompute, mb in [(1, 2, 1, "full", 2), (2, 2, 0, "none", 1), (1, 4, 1, "full", 1),
                                        (2, 1, 3, "full", 2), (1, 2, 3, "none", 1), (1, 1, 2, "none", 4)]:
        layout = Layout(tp=tp, pp=pp, dp=16 // (tp * pp), zero=zero, recompute=recompute, micro_batch=mb)
        if not spec.layout_problems(layout, model):
            layouts.append(layout)
    col = lambda f: np.array([f(x) for x in layouts])  # noqa: E731
    cands = Candidates(col(lambda x: x.tp), col(lambda x: x.pp), col(lambda x: x.dp), col(lambda x: x.micro_batch),
                       col(lambda x: x.vpp), col(lambda x: x.zero), col(lambda x: RECOMPUTE_CODES[x.recompute]),
                       col(lambda x: x.sequence_parallel), col(lambda x: 0))
    result = estimate_batch(CLUSTER, model, training, cands, ("tp-cp-ep-dp-pp",), spec)
    for i, layout in enumerate(layouts):
        est = estimate(CLUSTER, model, training, layout, spec)
        assert result["peak_memory_bytes"][i] == pytest.approx(est.peak_memory_bytes, rel=1e-9), layout


# ---- --gpu-memory ------------------------------------------------------------------------------
def test_gpu_memory_overrides_the_capacity(capsys):
    code, out, _ = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--tp", "8", "--gpu-memory", "94",
                           "--json")
    assert code == 0 and json.loads(out)["capacity_bytes"] == pytest.approx(94 * GIB * 0.95)


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "2e6"])
def test_a_bad_gpu_memory_is_one_line_and_exit_2(capsys, value):
    code, _, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--gpu-memory", value)
    assert code == 2 and "--gpu-memory" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_check_and_explain_take_gpu_memory(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: dgx-h100\nnodes: 1\nmodel: llama3-8b\ntraining: {global_batch: 64}\n"
                   "layout: {tp: 2, dp: 4, zero: 1, recompute: full, sequence_parallel: true}\n")
    assert run_cli(capsys, "check", job)[0] == 0
    code, out, _ = run_cli(capsys, "check", job, "--gpu-memory", "16")  # 8B states alone need more
    assert code == 1 and "exceeds" in out
    code, _, err = run_cli(capsys, "explain", "-c", "dgx-h100", "-m", "llama3-8b", "--tp", "8", "--gpu-memory", "0")
    assert code == 2 and "--gpu-memory" in err
