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
    # DeepSpeed's own invariant: batch = micro * accumulation * data-parallel size.
    assert config["train_batch_size"] == mb * config["gradient_accumulation_steps"] * dp == 64
    assert config["bf16"]["enabled"] == (precision == "bf16")
    assert config["fp16"]["enabled"] == (precision == "fp16")
    assert config.get("tensor_parallel", {"autotp_size": 1})["autotp_size"] == tp
    assert any("PipelineModule(num_stages=4" in n for n in emitted.notes) == (pp == 4)

@pytest.mark.parametrize("layout,needle", [
    ({"pp": 4, "dp": 8, "zero": 2}, "ZeRO-0/1"),
    ({"tp": 4, "dp": 8, "zero": 3}, "AutoTP"),
    ({"pp": 2, "dp": 16, "order": "tp-cp-ep-pp-dp"}, "rank order"),
])
def test_deepspeed_refuses(layout, needle):
    with pytest.raises(InfeasibleError, match=needle):
        emit_deepspeed(make_plan(**layout))
