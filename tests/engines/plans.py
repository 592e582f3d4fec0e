"""The plan matrix every engine check runs over: the layouts people hand to engines.

Covers tp 1-8, pp 1-16, interleaving (vpp), ZeRO 0-3, every recompute mode, sequence parallelism
on and off, uneven pipeline splits, both of Megatron's rank orders and one no engine builds,
grouped-query attention (llama3) and multi-head attention (gpt3), bf16 / fp16 / fp32, context
parallelism (cp 2 and 4, with tp, pp and dp). Each entry
is one plan; an emitter either emits it (and the engine's own code must accept it with the same
values) or refuses it (and the engine's own code must confirm the refusal).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    nodes: int
    layout: dict
    global_batch: int = 64
    precision: str = "bf16"
    seq_len: int | None = None
    tags: tuple[str, ...] = field(default=())


CASES = [
    Case("dp8-zero0", "llama3-8b", 1, dict(dp=8, zero=0)),
    Case("dp8-zero1", "llama3-8b", 1, dict(dp=8, zero=1)),
    Case("dp16-zero2", "llama3-8b", 2, dict(dp=16, zero=2, micro_batch=2)),
    Case("dp32-zero3-full", "llama3-8b", 4, dict(dp=32, zero=3, recompute="full", micro_batch=2)),
    Case("tp2-dp4-zero1-sp", "llama3-8b", 1, dict(tp=2, dp=4, zero=1, sequence_parallel=True)),
    Case("tp4-dp2-nosp", "llama3-8b", 1, dict(tp=4, dp=2, zero=0, sequence_parallel=False)),
    Case("tp8-dp4-zero1-selective", "llama3-8b", 4, dict(tp=8, dp=4, zero=1, sequence_parallel=True,
                                                        recompute="selective")),
    Case("tp4-dp8-zero3", "llama3-8b", 4, dict(tp=4, dp=8, zero=3, sequence_parallel=True)),
    Case("tp2-dp16-zero2", "llama3-8b", 4, dict(tp=2, dp=16, zero=2, sequence_parallel=True)),
    Case("pp2-dp4-zero1", "llama3-8b", 1, dict(pp=2, dp=4, zero=1)),
    Case("pp4-dp8-zero0-full", "llama3-8b", 4, dict(pp=4, dp=8, zero=0, recompute="full")),
    Case("pp4-dp8-zero2", "llama3-8b", 4, dict(pp=4, dp=8, zero=2)),
    Case("pp4-dp8-zero3", "llama3-8b", 4, dict(pp=4, dp=8, zero=3)),
    Case("tp2-pp2-dp2-vpp2", "llama3-8b", 1, dict(tp=2, pp=2, dp=2, vpp=2, zero=1, sequence_parallel=True)),
    Case("tp2-pp4-dp4-uneven", "llama3-8b", 4, dict(tp=2, pp=4, dp=4, zero=1, sequence_parallel=True,
                                                   pp_layers=(7, 9, 9, 7))),
    Case("pp4-dp8-uneven-middle", "llama3-8b", 4, dict(pp=4, dp=8, zero=1, pp_layers=(7, 9, 8, 8))),
    Case("tp2-pp4-dp4-ppdp-order", "llama3-8b", 4, dict(tp=2, pp=4, dp=4, zero=1, sequence_parallel=True,
                                                       order="tp-cp-ep-pp-dp")),
    Case("tp2-pp2-dp8-dp-first-order", "llama3-8b", 4, dict(tp=2, pp=2, dp=8, order="dp-tp-cp-ep-pp")),
    Case("tp8-pp16-dp4-gpt3-vpp", "gpt3-175b", 64, dict(tp=8, pp=16, dp=4, vpp=3, zero=1, sequence_parallel=True,
                                                       recompute="selective"), global_batch=1536),
    Case("tp8-pp8-dp8-gpt3-full", "gpt3-175b", 64, dict(tp=8, pp=8, dp=8, zero=1, recompute="full"),
         global_batch=1536, precision="fp16"),
    Case("tp8-pp4-dp4-llama70b", "llama3-70b", 16, dict(tp=8, pp=4, dp=4, vpp=5, zero=1, sequence_parallel=True),
         global_batch=512),
    Case("tp1-pp2-dp4-fp32", "llama3-8b", 1, dict(pp=2, dp=4, zero=1), precision="fp32"),
    Case("tp2-dp4-seq4096", "llama3-8b", 1, dict(tp=2, dp=4, zero=1, sequence_parallel=True), seq_len=4096),
    Case("tp8-cp4-dp2-seq32k", "llama3-8b", 8, dict(tp=8, cp=4, dp=2, zero=1, sequence_parallel=True),
         seq_len=32768),
    Case("tp4-cp2-pp2-dp2-seq16k", "llama3-70b", 4, dict(tp=4, cp=2, pp=2, dp=2, zero=1, sequence_parallel=True,
                                                        recompute="full"), global_batch=32, seq_len=16384),
]


def build(case: Case) -> Plan:
    """The plan of one case (no estimate: the emitters need the layout, model and batch only)."""
    cluster = load_cluster("dgx-h100", nodes=case.nodes)
    training = TrainingSpec(global_batch=case.global_batch, precision=case.precision, seq_len=case.seq_len)
    return build_plan(cluster, load_model(case.model), training, Layout(**case.layout))


def case_ids() -> list[str]:
    return [case.name for case in CASES]
