"""DeepSpeed ds_config: parsed back and checked against the plan."""
from __future__ import annotations

import json

import pytest

from emit_helpers import make_plan
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.errors import InfeasibleError


@pytest.mark.parametrize("tp,pp,dp,mb,zero,precision", [
    (1, 1, 32, 2, 3, "bf16"), (1, 4, 8, 1, 1, "fp16"), (4, 1, 8, 1, 2, "bf16"),
])
def test_deepspeed_values(tp, pp, dp, mb, zero, precision):
    plan = make_plan(tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, precision=precision)
    emitted = emit_deepspeed(plan)
    config = json.loads(emitted.text)
    assert config["zero_optimization"]["stage"] == zero
    assert config["train_micro_batch_size_per_gpu"] == mb
    # DeepSpeed's own invariant: batch = micro * accumulation * data-parallel size; with AutoTP it
    # divides by the whole world (no mpu), so the key is left for DeepSpeed to derive.
    assert mb * config["gradient_accumulation_steps"] * dp == 64
    assert config.get("train_batch_size", 64 if tp > 1 else None) == 64
    assert config["bf16"]["enabled"] == (precision == "bf16")
    assert config["fp16"]["enabled"] == (precision == "fp16")
    assert config.get("tensor_parallel", {"autotp_size": 1})["autotp_size"] == tp
    assert any("PipelineModule(num_stages=4" in n for n in emitted.notes) == (pp == 4)

@pytest.mark.parametrize("precision,fp32_grads,zero,accum", [
    ("bf16", None, 0, "bf16"), ("bf16", None, 1, "fp32"), ("bf16", None, 3, "fp32"), ("fp16", True, 0, "fp16"),
    ("fp16", True, 2, "fp32"), ("fp32", None, 0, "fp32"),
])
def test_deepspeed_accumulates_in_fp32_only_where_it_can(precision, fp32_grads, zero, accum):
    """DeepSpeed 0.19 refuses half-precision parameters with fp32 accumulation without ZeRO; a plan
    that budgets fp32 gradients there gets a note."""
    plan = make_plan(dp=32, zero=zero, precision=precision)
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"fp32_grad_accum": fp32_grads})})
    emitted = emit_deepspeed(plan)
    assert json.loads(emitted.text)["data_types"]["grad_accum_dtype"] == accum
    assert any("4-byte fp32 gradients" in n for n in emitted.notes) == (accum != "fp32")


@pytest.mark.parametrize("precision,accum", [("bf16", "fp32"), ("fp16", "fp16")])
def test_deepspeed_writes_the_gradient_dtype_the_plan_budgets(precision, accum):
    """Without a training choice the plan's engine decides (megatron-core: fp32 for bf16, fp16 for fp16)."""
    plan = make_plan(dp=32, zero=1, precision=precision)
    assert plan.grad_dtype == accum
    assert json.loads(emit_deepspeed(plan).text)["data_types"]["grad_accum_dtype"] == accum


def test_deepspeed_overlaps_the_reduction_where_its_optimizer_can():
    config = json.loads(emit_deepspeed(make_plan(dp=32, zero=2)).text)
    assert config["zero_optimization"]["overlap_comm"] is True
    piped = emit_deepspeed(make_plan(pp=4, dp=8, zero=1))
    assert "overlap_comm" not in json.loads(piped.text)["zero_optimization"]
    assert any("assumes it overlapped" in n for n in piped.notes)


@pytest.mark.parametrize("layout,needle", [
    ({"pp": 4, "dp": 8, "zero": 2}, "ZeRO-2 with pipeline"),
    ({"tp": 2, "pp": 2, "dp": 8, "zero": 1}, "tensor parallelism only without a pipeline"),
    ({"tp": 4, "dp": 8, "sequence_parallel": True}, "no sequence parallelism"),
    ({"pp": 2, "dp": 16, "order": "tp-cp-ep-pp-dp"}, "places ranks only as"),
])
def test_deepspeed_refuses(layout, needle):
    with pytest.raises(InfeasibleError, match=needle) as refused:
        emit_deepspeed(make_plan(**layout))
    assert "deepspeed-0.19" in str(refused.value)


def test_deepspeed_runs_autotp_with_zero3():
    """DeepSpeed 0.19 runs AutoTP with ZeRO-3 (runtime/engine.py _configure_tensor_parallel_states)."""
    config = json.loads(emit_deepspeed(make_plan(tp=4, dp=8, zero=3)).text)
    assert config["tensor_parallel"]["autotp_size"] == 4 and config["zero_optimization"]["stage"] == 3
