"""Megatron-LM arguments: parsed back and checked against the plan."""
from __future__ import annotations


import pytest

from emit_helpers import make_plan, parse_megatron
from plan3d.emit.megatron import emit_megatron
from plan3d.errors import InfeasibleError


@pytest.mark.parametrize("tp,pp,dp,vpp,mb,zero,sp,recompute", [
    (8, 4, 1, 2, 1, 1, True, "selective"),
    (4, 2, 4, 1, 2, 0, False, "full"),
    (2, 1, 16, 1, 4, 1, True, "none"),
])
def test_megatron_values(tp, pp, dp, vpp, mb, zero, sp, recompute):
    plan = make_plan(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=mb, zero=zero, sequence_parallel=sp,
                     recompute=recompute)
    args = parse_megatron(emit_megatron(plan).text)
    assert int(args["--tensor-model-parallel-size"]) == tp
    assert int(args["--pipeline-model-parallel-size"]) == pp
    assert int(args["--micro-batch-size"]) == mb
    assert int(args["--global-batch-size"]) == plan.training.global_batch
    assert ("--sequence-parallel" in args) == sp
    assert ("--use-distributed-optimizer" in args) == (zero == 1)
    assert args.get("--recompute-granularity", "none") == recompute
    if vpp > 1:
        assert int(args["--num-layers-per-virtual-pipeline-stage"]) * pp * vpp == plan.model.layers
    assert "--use-tp-pp-dp-mapping" not in args
    assert int(args["--num-layers"]) == plan.model.layers
    assert int(args["--num-query-groups"]) == plan.model.kv_heads_
    assert args["--normalization"] == "RMSNorm" and "--swiglu" in args and "--bf16" in args

def test_megatron_pp_dp_order_and_uneven_split():
    plan = make_plan(tp=2, pp=4, dp=4, order="tp-cp-ep-pp-dp", pp_layers=(7, 9, 9, 7))
    args = parse_megatron(emit_megatron(plan).text)
    assert "--use-tp-pp-dp-mapping" in args
    assert (args["--decoder-first-pipeline-num-layers"], args["--decoder-last-pipeline-num-layers"]) == ("7", "7")

@pytest.mark.parametrize("layout,needle", [
    ({"tp": 8, "pp": 1, "dp": 4, "zero": 3}, "ZeRO-3"),
    ({"tp": 2, "pp": 2, "dp": 8, "order": "dp-tp-cp-ep-pp"}, "rank order"),
    ({"tp": 1, "pp": 4, "dp": 8, "pp_layers": (7, 9, 8, 8)}, "middle stages"),
])
def test_megatron_refuses_what_it_cannot_express(layout, needle):
    with pytest.raises(InfeasibleError, match=needle):
        emit_megatron(make_plan(**layout))

def test_megatron_order_of_size_one_axes_does_not_matter():
    plan = make_plan(tp=8, pp=1, dp=4, order="tp-pp-cp-ep-dp")  # pp=1: same groups as the default
    assert "--use-tp-pp-dp-mapping" not in parse_megatron(emit_megatron(plan).text)
