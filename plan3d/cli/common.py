"""Options shared by several commands, and turning them into specs and a Layout."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from plan3d.errors import LayoutError, SpecError
from plan3d.layout import DEFAULT_ORDER, Layout
from plan3d.specs.catalog import engine_for, load_cluster, load_model, require_positive, with_gpu_memory
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.loader import validation_problems
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="Bundled cluster name or spec file.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Bundled model name or spec file.")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Override the cluster's node count.")]
GpnOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", help="Override GPUs per node.")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per step.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Override the sequence length.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16, fp16, fp8 or fp32.")]
GpuMemoryOpt = Annotated[Optional[float], typer.Option(
    "--gpu-memory", help="Override the GPUs' memory in GiB, for a variant of the cluster's GPU "
    "(94: H100 NVL, 96: GH200, 141: H200, 180/192: B200).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
OrderOpt = Annotated[str, typer.Option("--order", help="Rank order, first axis fastest.")]
EngineOpt = Annotated[Optional[str], typer.Option(
    "--engine", help="Training engine to predict for: a bundled name (`plan3d specs list`) or a spec file; "
    "default megatron-core (plan3d-runtime on CPU clusters).")]


def load_specs(cluster: str, model: str, nodes: int | None, gpus_per_node: int | None,
               global_batch: int | None, seq_len: int | None,
               precision: str = "bf16", gpu_memory: float | None = None) -> tuple[ClusterSpec, ModelSpec, TrainingSpec]:
    """Resolve names or paths and command-line overrides (--gpu-memory: catalog.with_gpu_memory)
    into validated specs."""
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node),
                        ("global_batch", global_batch), ("seq_len", seq_len)):
        require_positive(name, value)
    cluster_spec = with_gpu_memory(load_cluster(cluster, nodes, gpus_per_node), gpu_memory)
    model_spec = load_model(model)
    batch = global_batch or model_spec.default_global_batch
    if batch is None:
        raise SpecError("command line", [f"model {model_spec.name!r} has no default_global_batch; pass --global-batch"])
    training = make_training(global_batch=batch, seq_len=seq_len, precision=precision)
    return cluster_spec, model_spec, training


def load_engine_opt(engine: str | None, cluster: ClusterSpec, cp_comm: str | None = None, model=None,
                    ep_dispatcher: str | None = None, ep_overlap: str | None = None, act_offload: str | None = None):
    """The --engine spec, or the default engine for `cluster` and `model` (catalog.engine_for),
    running context parallelism's K/V exchange as --cp-comm and MoE tokens with --ep-dispatcher
    and --ep-overlap, and offloading activations as --act-offload, where given (EngineSpec.with_choice)."""
    spec = engine_for(engine, cluster, model).with_cp_comm(cp_comm).with_ep_dispatcher(ep_dispatcher)
    return spec.with_ep_overlap(ep_overlap).with_act_offload(act_offload)


def make_training(**fields) -> TrainingSpec:
    try:
        return TrainingSpec(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:
        raise SpecError("command line", validation_problems(err)) from err


def make_layout(**fields) -> Layout:
    """A Layout from command-line flags; a bad value becomes one LayoutError line per field."""
    try:
        return Layout(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:
        raise LayoutError("; ".join(validation_problems(err))) from err


__all__ = ["DEFAULT_ORDER", "load_engine_opt", "load_specs", "make_layout", "make_training"]

TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")]
DpOpt = Annotated[int, typer.Option("--dp", help="Data-parallel degree.")]
CpOpt = Annotated[int, typer.Option("--cp", help="Context-parallel degree: each sequence split over cp GPUs "
                                    "(2*cp load-balanced chunks; the sequence length must divide into them).")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (mixture-of-experts models): each MoE "
                                    "layer's experts split over ep of the dp*cp ranks; ep divides dp*cp and the "
                                    "routed experts.")]
EtpOpt = Annotated[Optional[int], typer.Option("--etp", help="Expert tensor-parallel degree (MoE Parallel Folding): "
                                                "each expert split over etp ranks, ep*etp of the tp*cp*dp ranks of a "
                                                "stage; default tp. Megatron-Core only.")]
MicroBatchOpt = Annotated[int, typer.Option("--micro-batch", help="Sequences per micro-batch.")]
VppOpt = Annotated[int, typer.Option("--vpp", help="Virtual pipeline stages per rank (interleaved 1F1B).")]
SCHEDULE_HELP = ("Pipeline schedule: 1f1b, interleaved-1f1b (vpp > 1), zb1p (zero bubble, vpp > 1), zbv or dualpipev "
                 "(V-shaped, vpp 2), dualpipe (DeepSeek's, two parameter copies); default: 1f1b, or interleaved-1f1b "
                 "with vpp > 1. Which ones an engine runs: its profile's can_run.schedules.")
ScheduleOpt = Annotated[Optional[str], typer.Option("--schedule", help=SCHEDULE_HELP)]
ZeroOpt = Annotated[int, typer.Option("--zero", help="ZeRO stage 0-3.")]
RecomputeOpt = Annotated[str, typer.Option("--recompute", help="none, selective, moe-act (Megatron-Core: the MoE activation and norm, MoE models), moe (Megatron-Core: the whole MoE layer and norm, MoE models), mla-up (Megatron-Core: MLA's up-projections, the norms and the experts' activation, MLA models), partial (Megatron-Core: full recompute of the fewest layers per virtual chunk that fit) or full.")]
SeqParallelOpt = Annotated[bool, typer.Option("--sequence-parallel", help="Megatron sequence parallelism.")]
CpCommOpt = Annotated[Optional[str], typer.Option(
    "--cp-comm", help="Context parallelism's K/V exchange: p2p (ring overlapped with attention), all_gather or a2a "
    "(Ulysses head split); default: what the engine runs (Megatron-Core p2p, torchtitan and plan3d-runtime "
    "all_gather).")]
EpDispatcherOpt = Annotated[Optional[str], typer.Option(
    "--ep-dispatcher", help="MoE token dispatcher with ep > 1: alltoall (every token copy to its expert's GPU), "
    "deepep or hybridep (hierarchical: a token crosses the network once per node it reaches, then NVLink); "
    "default: what the engine runs (alltoall).")]
EpOverlapOpt = Annotated[Optional[str], typer.Option(
    "--ep-overlap", help="How the MoE all-to-alls hide with ep > 1: none, or combined-1f1b (one micro-batch's "
    "forward interleaved with another's backward: Megatron-Core --overlap-moe-expert-parallel-comm); default: "
    "what the engine runs (none).")]
ActOffloadOpt = Annotated[Optional[str], typer.Option(
    "--act-offload", help="Activations moved to host memory between the forward and the backward: none, experts "
    "(the routed experts' FC1 and activation inputs, MoE models) or all (also the attention's QKV, core and "
    "projection inputs): Megatron-Core --fine-grained-activation-offloading; default: what the engine runs (none).")]
PlotOpt = Annotated[Optional[Path], typer.Option(
    "--plot", help="Also save a picture (.png, .svg or .pdf; needs matplotlib: pip install 'plan3d\\[plot]').")]
