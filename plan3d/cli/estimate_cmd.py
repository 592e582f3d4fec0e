"""`plan3d estimate`: memory and step time of one layout (issue 3)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from plan3d.cli.app import app
from plan3d.cli.common import (DEFAULT_ORDER, ClusterOpt, CpCommOpt, EpDispatcherOpt, EpOverlapOpt, ActOffloadOpt, CpOpt, EngineOpt, EpOpt, EtpOpt, GlobalBatchOpt, GpnOpt,
                               GpuMemoryOpt, JsonOpt, MicroBatchOpt,
                               ModelOpt, NodesOpt, OrderOpt, PlotOpt, PpOpt, RecomputeOpt,
                               SeqLenOpt, SeqParallelOpt, ScheduleOpt, TpOpt, VppOpt, ZeroOpt, load_engine_opt, load_specs,
                               make_layout)
from plan3d.cli.recommend_cmd import PrecisionOpt
from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import check_layout
from plan3d.render.estimate import print_estimate
from plan3d.render.plots import plot_step_breakdown  # imports matplotlib only when it draws
from plan3d.render.units import json_text
from plan3d.specs.training import with_precision

SCHEMA_VERSION = 1  # of the --json output
DpOptional = Annotated[Optional[int], typer.Option("--dp", help="Data-parallel degree (default: fill the cluster).")]


@app.command("estimate")
def estimate_command(
    cluster: ClusterOpt,
    model: ModelOpt,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    dp: DpOptional = None,
    cp: CpOpt = 1,
    ep: EpOpt = 1,
    etp: EtpOpt = None,
    micro_batch: MicroBatchOpt = 1,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    vpp: VppOpt = 1,
    schedule: ScheduleOpt = None,
    zero: ZeroOpt = 0,
    recompute: RecomputeOpt = "none",
    sequence_parallel: SeqParallelOpt = False,
    order: OrderOpt = DEFAULT_ORDER,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    precision: PrecisionOpt = None,
    engine: EngineOpt = None,
    cp_comm: CpCommOpt = None,
    ep_dispatcher: EpDispatcherOpt = None,
    ep_overlap: EpOverlapOpt = None,
    act_offload: ActOffloadOpt = None,
    json_out: JsonOpt = False,
    plot: PlotOpt = None,
) -> None:
    """Predict the memory of every rank and the time of one training step for one layout, as an engine runs it."""
    cluster_spec, model_spec, training = load_specs(cluster, model, nodes, gpus_per_node, global_batch,
                                                    seq_len, precision, gpu_memory)
    training = with_precision(training, cluster_spec.gpu, precision)
    engine_spec = load_engine_opt(engine, cluster_spec, cp_comm, model_spec, ep_dispatcher, ep_overlap, act_offload)
    flags = dict(tp=tp, pp=pp, cp=cp, micro_batch=micro_batch, vpp=vpp, schedule=schedule, zero=zero, recompute=recompute,
                 sequence_parallel=sequence_parallel, order=order)
    if dp is None:
        dp = _fill_dp(cluster_spec.world_size, make_layout(dp=1, **flags), model_spec, training)
    layout = make_layout(dp=dp, ep=ep, etp=etp, **flags)
    result = estimate(cluster_spec, model_spec, training, layout, engine_spec)
    if plot is not None:
        plot_step_breakdown(result.to_dict(), plot, title=f"{model_spec.name} on {cluster_spec.nodes} x "
                            f"{cluster_spec.gpus_per_node} {cluster_spec.gpu.name}, {engine_spec.name}")
    if json_out:
        print(json_text({"schema_version": SCHEMA_VERSION, **result.to_dict()}))
    else:
        print_estimate(result, cluster_spec, model_spec, training, engine_spec)


def _fill_dp(world: int, layout, model, training) -> int:
    """dp that fills the cluster when --dp is not given; problems of tp, pp and cp come first."""
    model_parallel = layout.tp * layout.pp * layout.cp
    if world % model_parallel == 0:
        return world // model_parallel
    check_layout(layout.model_copy(update={"micro_batch": 1}), model, training, world)
    product = "tp*pp*cp" if layout.cp > 1 else "tp*pp"
    raise LayoutError(f"{product} = {model_parallel} does not divide the cluster's {world} GPUs, so dp cannot fill it; "
                      f"pass --dp or choose {product} among the divisors of {world}")
