"""torchtitan job config: parsed back and checked against the plan."""
from __future__ import annotations

import tomllib

import pytest

from emit_helpers import make_plan
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError


@pytest.mark.parametrize("tp,pp,dp,vpp,mb,zero,recompute", [
    (2, 4, 4, 2, 1, 3, "full"), (8, 1, 4, 1, 2, 2, "selective"), (1, 1, 32, 1, 2, 0, "none"),
])
def test_torchtitan_values(tp, pp, dp, vpp, mb, zero, recompute):
    plan = make_plan(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch=mb, zero=zero, recompute=recompute,
                     sequence_parallel=tp > 1)
    toml = tomllib.loads(emit_torchtitan(plan).text)
    par, train = toml["parallelism"], toml["training"]
    assert par["tensor_parallel_degree"] == tp and par["pipeline_parallel_degree"] == pp
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == dp
    assert (par["data_parallel_shard_degree"] == dp) == (zero >= 2)
    assert (par.get("fsdp_reshard_after_forward") == "never") == (zero == 2)
    assert train["global_batch_size"] == 64 and train["seq_len"] == plan.model.seq_len
    assert toml["activation_checkpoint"]["mode"] == recompute
    if pp > 1:
        assert par["pipeline_parallel_schedule"] == ("Interleaved1F1B" if vpp > 1 else "1F1B")
        assert par["pipeline_parallel_layers_per_stage"] * pp * vpp == plan.model.layers
        assert train["local_batch_size"] * dp == 64 and par["pipeline_parallel_microbatch_size"] == mb
    else:
        assert train["local_batch_size"] == mb

def test_torchtitan_uneven_split_points_and_refusals():
    plan = make_plan(pp=4, dp=8, zero=3, pp_layers=(7, 9, 9, 7))
    par = tomllib.loads(emit_torchtitan(plan).text)["parallelism"]
    assert par["pipeline_parallel_split_points"] == ["layers.7", "layers.16", "layers.25"]
    with pytest.raises(InfeasibleError, match="ZeRO-1"):
        emit_torchtitan(make_plan(dp=32, zero=1))
    with pytest.raises(InfeasibleError, match="DDP"):
        emit_torchtitan(make_plan(tp=2, dp=16, zero=0))
