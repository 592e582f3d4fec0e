"""`estimate()`: memory of every rank and the time of one step for one layout (the contract the
search, the CLI and the runtime code against)."""
from __future__ import annotations

import numpy as np

from plan3d.cost.arrays import layout_arrays
from plan3d.cost.bands import Band, Region, band_of, sharded_stages
from plan3d.cost.comm import GROUPS, layout_links
from plan3d.cost.finite import require_finite
from plan3d.cost.memory import rank_layer_counts
from plan3d.cost.trust import provenance
from plan3d.cost.context import make_context
from plan3d.cost.core import Links, evaluate, link_row
from plan3d.errors import LayoutError
from plan3d.layout import Layout, check_layout
from plan3d.rankmap import rankmap_for
from plan3d.records import Estimate
from plan3d.specs import schedule as schedules
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import MEMORY_TERMS, RECOMPUTE_CODES, TIME_TERMS, UTILISATION


def estimate(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, layout: Layout,
             engine: EngineSpec | None = None) -> Estimate:
    """Predict memory and step time of `layout` as `engine` runs it; raises LayoutError if it
    cannot run (or the engine cannot run it). No engine: the cluster's GPU values alone.

    A layout smaller than the cluster runs on its first GPUs (whole nodes first); a pp*vpp that
    does not divide the layers gets the engine's split (`EngineSpec.default_split`: Megatron-
    DeepSpeed's own partition, or the balanced split an engine taking per-stage counts is given,
    with a note)."""
    notes = []
    if engine is not None:
        notes = [n for n in (engine.zero_note(layout), engine.split_note(layout, model)) if n]
        layout = engine.resolve_split(layout, model)
        problems = engine.job_problems(layout, model, training)
        if problems:
            raise LayoutError("; ".join(problems))
    check_layout(layout, model, training, cluster.world_size)
    ctx = make_context(cluster, model, training, engine)
    tiers = tuple(cluster.tiers())
    links = layout_links(layout.tp, layout.pp, layout.dp, layout.order, tiers, cluster.gpus_per_node, layout.cp,
                         layout.ep, layout.etp)
    la = layout_arrays(training.global_batch, [layout.tp], [layout.pp], [layout.dp], [layout.micro_batch],
                       [layout.vpp], [layout.zero], [RECOMPUTE_CODES[layout.recompute]],
                       [float(layout.sequence_parallel)], [layout.cp], [layout.ep],
                       None if layout.etp is None else [layout.etp], [schedules.code_of(layout.pipeline_schedule)])
    link_arrays = Links.from_rows(np.array([link_row(links)], dtype=np.float64))
    counts = [rank_layer_counts(model, layout, r) for r in range(layout.pp)]
    layers = np.array([c[0] for c in counts], dtype=np.float64)[:, None]
    moe_layers = np.array([c[1] for c in counts], dtype=np.float64)[:, None]
    pp_rank = np.arange(layout.pp, dtype=np.float64)[:, None]
    out = evaluate(ctx, la, link_arrays, pp_rank, layers, np.ones_like(layers), moe_layers)
    result = _to_estimate(out, layout, _tiers(links, layout), notes + _warnings(cluster, model, layout))
    require_finite(_numbers(result), cluster, model, training, engine)
    trust = provenance(cluster, engine, training, layout.zero)
    band = layout_band(cluster, model, training, layout, engine)
    return result.with_values(engine=engine.name if engine else "", provenance=trust.lines,
                   warnings=result.warnings + trust.warnings, cp_comm=ctx.cp_comm if layout.cp > 1 else "",
                   ep_dispatcher=(engine.runs_as.ep_dispatcher if engine else "alltoall") if layout.ep > 1 else "",
                   ep_overlap=(engine.runs_as.ep_overlap if engine else "none") if layout.ep > 1 else "",
                   act_offload=engine.runs_as.act_offload if engine else "none",
                   step_time_s_band=list(band.step_band(result.step_time_s)), validated=band.validated,
                   region=band.summary(), grad_dtype=ctx.grad_label)


def layout_band(cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, layout: Layout,
                engine: EngineSpec | None) -> Band:
    """The error band of a prediction of `layout` (plan3d.cost.bands): its region's left-out errors."""
    region = Region.of(engine.name if engine else "", cluster.gpu.generation_name, layout.zero, layout.cp,
                       model.moe is not None, training.precision, sharded_stages(engine), layout.pipeline_schedule,
                       offload=bool(engine and engine.runs_as.act_offload != "none"))
    return band_of(region, layout.world_size)


def _tiers(links: dict, layout: Layout) -> dict:
    """The tier each group spans: tp, pp, dp; with context parallelism also cp (its ring) and
    dp_cp (the group gradients are reduced over); with expert parallelism ep (the all-to-all) and
    edp (the experts' gradients)."""
    shown = (GROUPS + (("cp", "dp_cp") if layout.cp > 1 else ()) + (("ep", "edp") if layout.ep > 1 else ())
             + (("etp",) if layout.etp is not None else ()))
    return {k: links[k].tier for k in shown}


def _numbers(est: Estimate) -> dict:
    """The numeric terms of an estimate (for `require_finite`)."""
    keys = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", *UTILISATION, "peak_memory_bytes", "capacity_bytes",
            "bubble_fraction", "time_s", "memory_bytes", "stage_memory_bytes")
    return {k: getattr(est, k) for k in keys}


def _to_estimate(out: dict, layout: Layout, tiers: dict, warnings: list[str]) -> Estimate:
    scalar = lambda a: float(np.asarray(a).reshape(-1)[0])  # noqa: E731
    worst = int(np.asarray(out["worst_stage"]).reshape(-1)[0])
    stage = out["stage_memory"]
    peak, capacity = scalar(out["peak_memory_bytes"]), scalar(out["capacity_bytes"])
    if peak > capacity:
        warnings = warnings + [f"does not fit: pipeline rank {worst} needs {peak / 2**30:.1f} GiB of "
                               f"{capacity / 2**30:.1f} GiB usable"]
    return Estimate.fresh(
        step_time_s=scalar(out["step_time_s"]), tokens_per_s=scalar(out["tokens_per_s"]),
        model_tflops_per_gpu=scalar(out["model_tflops_per_gpu"]), **{k: scalar(out[k]) for k in UTILISATION},
        peak_memory_bytes=peak, capacity_bytes=capacity, fits=peak <= capacity,
        bubble_fraction=scalar(out["bubble_fraction"]),
        memory_bytes={k: float(stage[k][worst, 0]) for k in MEMORY_TERMS},
        stage_memory_bytes=[float(v) for v in stage["total"][:, 0]],
        host_offload_bytes=float(np.max(stage["host_offload"][:, 0])),
        time_s={k: scalar(out["time_s"][k]) for k in TIME_TERMS},
        tiers=tiers, worst_pp_rank=worst, warnings=warnings,
        layout=layout.model_dump(mode="json"), recompute_layers=int(scalar(out["recompute_layers"])),
    )


def _warnings(cluster: ClusterSpec, model: ModelSpec, layout: Layout) -> list[str]:
    out = list(rankmap_for(layout, cluster.gpus_per_node).warnings(cluster.tiers()))
    out += moe_warnings(model)
    idle = idle_gpus_warning(layout.world_size, cluster.world_size)
    return out + ([idle] if idle else [])


def moe_warnings(model: ModelSpec) -> list[str]:
    """What the cost model approximates of a mixture-of-experts or latent-attention model."""
    out = []
    if model.moe is not None and model.moe.capacity_factor is not None:
        out.append(f"capacity factor {model.moe.capacity_factor:g}: every expert-parallel rank is costed at that "
                   "multiple of its even share of tokens (padded to capacity); the quality cost of dropped tokens "
                   "is not modelled")
    if model.mla is not None:
        out.append("multi-head latent attention: K and V costed as materialised per head (nope + rope, v_head "
                   "wide); the latent activations are not counted")
    return out


def idle_gpus_warning(layout_gpus: int, cluster_gpus: int) -> str | None:
    """'the layout uses 256 of the cluster's 512 GPUs' when some GPUs would sit idle."""
    if layout_gpus >= cluster_gpus:
        return None
    return f"the layout uses {layout_gpus} of the cluster's {cluster_gpus} GPUs ({cluster_gpus - layout_gpus} idle)"
