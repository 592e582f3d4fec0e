"""RunsAs.tp_overlap_conflict: Megatron-FSDP (ZeRO-2/3) and tensor-parallel communication overlap
cannot run together before Blackwell (Megatron-LM validate_args: FSDP needs
CUDA_DEVICE_MAX_CONNECTIONS > 1, the TP overlap needs 1). One rule in the engine profile, read by
the cost model (no TP overlap credited) and by the Megatron emitter (no --tp-comm-overlap)."""
from __future__ import annotations

import pytest

from emit_helpers import parse_megatron
from plan3d.cost.estimate import estimate
from plan3d.emit.megatron import emit_megatron
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec

TRAINING = TrainingSpec(global_batch=64)
MODEL = "llama3-8b"


def tp_comm(cluster_name: str, zero: int, engine) -> float:
    cluster = load_cluster(cluster_name, nodes=4)
    layout = Layout(tp=4, dp=cluster.world_size // 4, zero=zero, sequence_parallel=True)
    return estimate(cluster, load_model(MODEL), TRAINING, layout, engine).time_s["tp_comm"]


@pytest.fixture(scope="module")
def engines():
    core = load_engine("megatron-core")
    blocking = core.model_copy(update={"runs_as": core.runs_as.model_copy(update={"tp_overlap_fraction": 0.0})})
    return core, blocking


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-a100-80g"])
def test_before_blackwell_fsdp_hides_no_tp_communication(engines, cluster):
    core, blocking = engines
    assert tp_comm(cluster, 3, core) == pytest.approx(tp_comm(cluster, 3, blocking), rel=1e-12)
    assert tp_comm(cluster, 2, core) == pytest.approx(tp_comm(cluster, 2, blocking), rel=1e-12)
    # the distributed optimizer keeps the overlap: half of the same exchange hidden
    assert tp_comm(cluster, 1, core) < 0.75 * tp_comm(cluster, 1, blocking)


def test_on_blackwell_fsdp_keeps_the_tp_overlap(engines):
    core, blocking = engines
    assert tp_comm("gb200-nvl72", 3, core) < 0.75 * tp_comm("gb200-nvl72", 3, blocking)


def emitted(cluster_name: str, zero: int):
    cluster = load_cluster(cluster_name, nodes=4)
    layout = Layout(tp=4, dp=cluster.world_size // 4, zero=zero, sequence_parallel=True)
    plan = build_plan(cluster, load_model(MODEL), TRAINING, layout, engine=load_engine("megatron-core"))
    out = emit_megatron(plan)
    return parse_megatron(out.text), out


def test_the_emitter_reads_the_same_rule():
    args, out = emitted("dgx-h100", 3)
    assert "--use-megatron-fsdp" in args and "--tp-comm-overlap" not in args
    assert any("--tp-comm-overlap is off" in n and "CUDA_DEVICE_MAX_CONNECTIONS" in n for n in out.notes)
    assert "--tp-comm-overlap" in emitted("dgx-h100", 1)[0]  # the distributed optimizer keeps it
    assert "--tp-comm-overlap" in emitted("gb200-nvl72", 3)[0]  # Blackwell: the requirement is gone
