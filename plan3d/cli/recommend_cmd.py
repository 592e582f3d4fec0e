"""`plan3d recommend` and `plan3d explain`: parse -> load -> search -> rank -> render (issue 5)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from plan3d.cli.app import app
from plan3d.render.units import json_text
from plan3d.cli.common import (SCHEDULE_HELP, ClusterOpt, CpCommOpt, EpDispatcherOpt, EpOverlapOpt, ActOffloadOpt, CpOpt, EngineOpt, GlobalBatchOpt, GpnOpt,
                               GpuMemoryOpt, JsonOpt, ModelOpt, ScheduleOpt, NodesOpt, PlotOpt, SeqLenOpt, load_engine_opt, load_specs, make_layout)
from plan3d.errors import InfeasibleError, LayoutError
from plan3d.specs.training import with_precision
from plan3d.vocab import RECOMPUTE_CODES

IntOpt = Optional[int]
# --precision of the planning commands (recommend, explain, estimate): the default follows the
# cluster's GPU (plan3d.specs.training.default_precision), so a plan predicts what launch trains
PrecisionOpt = Annotated[Optional[str], typer.Option(
    "--precision", help="bf16, fp16, fp8 or fp32; default fp32 on a cluster of CPU processes (plan3d's runtime "
    "trains fp32 there), else bf16.")]
MinMfuOpt = Annotated[Optional[float], typer.Option("--min-mfu", help="Reject layouts predicted below this MFU (0-1).")]
MaxMemFracOpt = Annotated[Optional[float], typer.Option(
    "--max-memory-fraction", help="Reject layouts whose peak memory exceeds this fraction of the GPU's memory.")]
ObjectiveOpt = Annotated[str, typer.Option("--objective", help="throughput (tokens/s), mfu or memory.")]
RankingOpt = Annotated[str, typer.Option(
    "--ranking", help="How error bands count: expected (default: the prediction, but a layout extrapolated on more "
    "features ranks higher only when it wins beyond both bands), optimistic (each band's fast end) or conservative "
    "(each band's slow end).")]
MAX_TOKENS = 1e16  # far above any training run (Llama 3: 1.5e13 tokens); keeps days-to-train a sane number
TokensOpt = Annotated[Optional[float], typer.Option(
    "--tokens", help="Token budget: also show the time to train it (at most 1e16, far above any training run).")]


def _opt(flag: str, text: str):
    return typer.Option(flag, help=text)


@app.command("recommend")
def recommend(
    cluster: ClusterOpt,
    model: ModelOpt,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = None,
    engine: EngineOpt = None,
    cp_comm: CpCommOpt = None,
    ep_dispatcher: EpDispatcherOpt = None,
    ep_overlap: EpOverlapOpt = None,
    act_offload: ActOffloadOpt = None,
    top: Annotated[int, _opt("--top", "How many layouts to show.")] = 10,
    objective: ObjectiveOpt = "throughput",
    ranking_mode: RankingOpt = "expected",
    json_out: JsonOpt = False,
    out: Annotated[Optional[Path], _opt("--out", "Write the Plan JSON of the best (or --pick) layout.")] = None,
    pick: Annotated[int, _opt("--pick", "Which ranked layout --out and --explain use (1 = best).")] = 1,
    explain: Annotated[bool, _opt("--explain", "Explain the picked layout against the best.")] = False,
    tp: Annotated[IntOpt, _opt("--tp", "Fix the tensor-parallel degree.")] = None,
    min_tp: Annotated[int, _opt("--min-tp", "Lower bound on tp.")] = 1,
    max_tp: Annotated[IntOpt, _opt("--max-tp", "Upper bound on tp.")] = None,
    pp: Annotated[IntOpt, _opt("--pp", "Fix the pipeline-parallel degree.")] = None,
    min_pp: Annotated[int, _opt("--min-pp", "Lower bound on pp.")] = 1,
    max_pp: Annotated[IntOpt, _opt("--max-pp", "Upper bound on pp.")] = None,
    dp: Annotated[IntOpt, _opt("--dp", "Fix the data-parallel degree.")] = None,
    min_dp: Annotated[int, _opt("--min-dp", "Lower bound on dp.")] = 1,
    max_dp: Annotated[IntOpt, _opt("--max-dp", "Upper bound on dp.")] = None,
    cp: Annotated[IntOpt, _opt("--cp", "Fix the context-parallel degree.")] = None,
    min_cp: Annotated[int, _opt("--min-cp", "Lower bound on cp.")] = 1,
    max_cp: Annotated[IntOpt, _opt("--max-cp", "Upper bound on cp (default: seq-len / 8192, so that each GPU "
                                   "keeps at least 8,192 tokens of a sequence; cp 1 for shorter sequences).")] = None,
    ep: Annotated[IntOpt, _opt("--ep", "Fix the expert-parallel degree (mixture-of-experts models; it divides "
                               "dp*cp and the routed experts).")] = None,
    min_ep: Annotated[int, _opt("--min-ep", "Lower bound on ep.")] = 1,
    max_ep: Annotated[IntOpt, _opt("--max-ep", "Upper bound on ep (default: the routed experts of an MoE model, "
                                   "1 for a dense one).")] = None,
    etp: Annotated[IntOpt, _opt("--etp", "Fix the experts' tensor-parallel degree (MoE Parallel Folding, "
                                "Megatron-Core; default: etp = tp and ETP1 searched where the engine runs it).")] = None,
    micro_batch: Annotated[IntOpt, _opt("--micro-batch", "Fix the micro-batch size.")] = None,
    max_micro_batch: Annotated[int, _opt("--max-micro-batch", "Largest micro-batch tried.")] = 8,
    vpp: Annotated[IntOpt, _opt("--vpp", "Fix the virtual pipeline stages per rank.")] = None,
    max_vpp: Annotated[int, _opt("--max-vpp", "Most virtual stages per rank tried.")] = 8,
    schedule: Annotated[Optional[list[str]], _opt("--schedule", "Allowed pipeline schedule(s); repeat the flag "
                                                  "(default: every schedule the engine runs). " + SCHEDULE_HELP)] = None,
    zero: Annotated[Optional[list[int]], _opt("--zero", "Allowed ZeRO stage(s); repeat the flag.")] = None,
    recompute: Annotated[Optional[list[str]], _opt("--recompute", "Allowed recompute mode(s).")] = None,
    no_recompute: Annotated[bool, _opt("--no-recompute", "Never recompute activations.")] = False,
    sequence_parallel: Annotated[Optional[bool], typer.Option(
        "--sequence-parallel/--no-sequence-parallel", help="Force sequence parallelism on or off.")] = None,
    order: Annotated[Optional[list[str]], _opt("--order", "Allowed rank order(s); repeat the flag.")] = None,
    uneven: Annotated[Optional[bool], typer.Option(
        "--uneven/--even", help="Uneven layer splits when pp*vpp does not divide the layers (first and last "
        "stages lighter, as emit writes them): default on for engines that take per-stage counts; --even: "
        "even splits only.")] = None,
    min_nodes: Annotated[IntOpt, _opt("--min-nodes", "With --max-nodes: how many nodes do I need?")] = None,
    max_nodes: Annotated[IntOpt, _opt("--max-nodes", "Largest node count of the sweep.")] = None,
    min_mfu: MinMfuOpt = None,
    max_memory_fraction: MaxMemFracOpt = None,
    tokens: TokensOpt = None,
    plot: PlotOpt = None,
) -> None:
    """The best layouts of a model on a cluster that an engine can run, ranked, with reasons and rejection counts."""
    from plan3d import ranking, search
    from plan3d.render import recommend as render

    space = space_from_flags(locals())
    specs = load_specs(cluster, model, nodes, gpus_per_node, global_batch, seq_len, precision, gpu_memory)
    specs = (*specs[:2], with_precision(specs[2], specs[0].gpu, precision))
    engine_spec = load_engine_opt(engine, specs[0], cp_comm, specs[1], ep_dispatcher, ep_overlap, act_offload)
    space = search.engine_space(space, engine_spec)  # a knob the engine cannot run fails here, before the search
    thresholds = dict(_thresholds(min_mfu, max_memory_fraction), engine=engine_spec)
    if tokens is not None and not 0 < tokens <= MAX_TOKENS:  # nan and inf fail this too
        raise LayoutError(f"--tokens {tokens:g}: give the token budget as a positive number up to {MAX_TOKENS:.0e} "
                          "(far above any training run), e.g. 3e11")
    sweep = None
    if min_nodes is not None or max_nodes is not None:
        counts = search.node_counts(min_nodes or 1, max_nodes or specs[0].nodes)
        sweep = search.sweep_nodes(*specs, counts, space, **thresholds)
        result = next((r for r in sweep if r.feasible_count), sweep[-1])
    else:
        result = search.search(*specs, space, **thresholds)
    order_ = ranking.rank(result, objective, ranking_mode)
    notes = [n for n in (_cp_bound_note(space, specs, engine_spec),
                         _dispatcher_note(result, specs, engine_spec, ep_dispatcher),
                         _offload_note(result, specs, thresholds, act_offload) if sweep is None else "",
                         _ep_note(result, order_)) if n]
    report = render.Recommendation(result, order_, objective, top, pick, sweep, tokens, notes, ranking=ranking_mode)
    _require_pick(report)
    if not result.feasible_count:
        _no_fit(report, space, thresholds, json_out)
    if out is not None:
        _write_plan(result, report.picked_row, out)
        report.notes.append(f"wrote the plan of #{pick} to {out}")
    if plot is not None:
        from plan3d.render.plots import plot_pareto

        picked = report.picked_row
        plot_pareto(render.pareto_points(result, order_, picked, pick), plot,
                    float(result.metrics["capacity_bytes"][0]), render.picked_index(result, order_, picked))
        report.notes.append(f"wrote the throughput-vs-memory picture to {plot}")
    if json_out:
        print(json_text(render.recommendation_dict(report, explain)))
    else:
        render.print_recommendation(report, explain)


def _cp_bound_note(space, specs, engine) -> str:
    """Why cp was not searched when only its default bound kept it at 1 (an expert expects CP at
    8K-32K tokens: NeMo's Llama-3-70B recipe runs CP2 at 8K)."""
    from plan3d.search import CP_AUTO_MIN_TOKENS

    seq = specs[2].seq_len or specs[1].seq_len
    if space.max_cp is not None or not engine.can_run.context_parallel or space.cp_bound(seq) > 1:
        return ""
    return (f"cp not searched: by default each GPU keeps at least {CP_AUTO_MIN_TOKENS:,} tokens of a sequence "
            f"(seq-len {seq:,} -> cp 1); --max-cp 2 searches context parallelism too")


def _dispatcher_note(result, specs, engine, chosen: str | None) -> str:
    """What a hierarchical MoE dispatcher the engine can run (DeepEP, or HybridEP where the NVLink
    domain spans nodes) would make of the layouts that fit, when the user left the dispatcher at
    the engine's all-to-all: memory does not depend on it, so the same fitting layouts are priced
    again (`search.evaluate`) and the fastest is named if it beats the fastest with the
    all-to-all by more than 3%."""
    from plan3d.search import evaluate, layout_at
    from plan3d.specs.engine import HIERARCHICAL_DISPATCHERS

    cluster, model = specs[0], specs[1]
    options = [d for d in engine.can_run.ep_dispatchers if d in HIERARCHICAL_DISPATCHERS
               and not engine.with_ep_dispatcher(d).model_problems(model)]
    if model.moe is None or chosen is not None or engine.runs_as.ep_dispatcher != "alltoall" or not options:
        return ""
    rows = np.flatnonzero(result.feasible & (result.layouts["ep"] > 1))
    if not len(rows):
        return ""
    wide = cluster.tiers()[0].domain_gpus > cluster.gpus_per_node
    dispatcher = "hybridep" if wide and "hybridep" in options else options[0]
    sample = {k: a[rows] for k, a in result.layouts.items()}
    times = evaluate(*specs, sample, result.orders, engine.with_ep_dispatcher(dispatcher))["step_time_s"]
    best, fastest = int(np.argmin(times)), float(result.metrics["step_time_s"][result.feasible].min())
    if not times[best] < 0.97 * fastest:
        return ""
    layout = layout_at(sample, result.orders, best, model.layers)
    return (f"with --ep-dispatcher {dispatcher} (its kernels installed; a token crosses the network once per node "
            f"it reaches): {layout.short()} at {times[best]:.1f} s, {1 - times[best] / fastest:.0%} less than the "
            f"fastest layout with the all-to-all ({fastest:.1f} s); re-run with it to rank them")


def _ep_note(result, order) -> str:
    """For an MoE model, the fastest fitting layout at each expert-parallel degree the search
    evaluated, against #1, with the time term that grows most: why a published recipe's EP64 (or
    any other ep) is not at the top. '' for a dense model, or when only one ep fits."""
    from plan3d.vocab import TIME_TERMS, seconds_column

    if result.model.moe is None or not result.feasible_count or "ep" not in result.layouts:
        return ""
    ep, times = result.layouts["ep"], result.metrics["step_time_s"]
    top = int(order[0])
    fitting = sorted(set(ep[result.feasible].tolist()))
    if len(fitting) < 2:
        return ""
    parts = []
    for value in sorted(set(ep.tolist())):
        rows = np.flatnonzero(result.feasible & (ep == value))
        if not len(rows):
            parts.append(f"ep{value} none fits")
            continue
        best = int(rows[np.argmin(times[rows])])
        if value == ep[top]:
            parts.append(f"ep{value} {times[top]:.1f} s (#1)")
            continue
        if times[best] < times[top]:
            tier = result.metrics.get("band_tier")
            why = ("a less validated region" if tier is not None and tier[best] > tier[top]
                   else "its error band or the objective")
            parts.append(f"ep{value} {times[best]:.1f} s (ranked below #1: {why})")
            continue
        grow = {t: float(result.metrics[seconds_column(t)][best] - result.metrics[seconds_column(t)][top])
                for t in TIME_TERMS if seconds_column(t) in result.metrics}
        term = max(grow, key=grow.get)
        why = f", {term.replace('_', ' ')} +{grow[term]:.1f} s" if grow[term] > 0 else ""
        parts.append(f"ep{value} {times[best]:.1f} s{why}")
    return "fastest fitting layout per expert-parallel degree: " + "; ".join(parts)


def _offload_note(result, specs, thresholds: dict, chosen: str | None) -> str:
    """What offloading the routed experts' activations to host memory (Megatron-Core's fine-grained
    activation offloading, `--act-offload experts`) would make of the search, for an MoE model when
    the engine can and the user left it at the engine's none: memory changes, so the space is
    searched again with the offloading profile, and its fastest layout is named where nothing fit
    without or where it beats the fastest without by more than 3%. Offloading adds copy time and
    frees memory, so only two kinds of layout can win: one refused for memory (the GPU's or
    --max-memory-fraction) that was already faster than that, and partial recompute, which
    recomputes fewer layers when memory frees (whatever refused it before);
    those are predicted again (`search.reevaluate`), not the whole space."""
    from plan3d import search

    engine, model = thresholds["engine"], specs[1]
    if (model.moe is None or chosen is not None or engine.runs_as.act_offload != "none"
            or "experts" not in engine.can_run.act_offloads or not len(result.layouts.get("tp", ()))):
        return ""
    step = result.metrics["step_time_s"]
    fastest = float(step[result.feasible].min()) if result.feasible_count else np.inf
    memory = np.isin(result.codes, (search.MEMORY_CODE, search.MEMORY_FRACTION_CODE))  # both are memory
    partial = result.layouts["recompute"] == RECOMPUTE_CODES["partial"]  # fewer layers redone: faster, higher MFU
    which = (memory & (step < 0.97 * fastest)) | partial
    index, metrics, codes = search.reevaluate(result, engine.with_act_offload("experts"), which,
                                              thresholds.get("min_mfu"), thresholds.get("max_memory_fraction"))
    if not (codes == 0).any():
        return ""
    times = np.where(codes == 0, metrics["step_time_s"], np.inf)
    best = int(np.argmin(times))
    how = (f"with --act-offload experts (the experts' FC1 and activation inputs kept in host memory, "
           f"{specs[0].gpu.host_link_gbytes_per_s:g} GB/s each way): {result.layout(int(index[best])).short()} "
           f"at {times[best]:.1f} s")
    if not result.feasible_count:
        return f"nothing fits on the GPU alone; {how}; re-run with it"
    if not times[best] < 0.97 * fastest:
        return ""
    return f"{how}, {1 - times[best] / fastest:.0%} less than the fastest layout without ({fastest:.1f} s); re-run with it to rank them"


def space_from_flags(flags: dict):
    """The search Space of the knob flags (fixed values become equal bounds)."""
    from plan3d.search import DEFAULT_ORDERS, Space
    from plan3d.vocab import RECOMPUTE_MODES

    def bound(knob: str, lo: int, hi: int | None) -> dict:
        fixed = flags.get(knob)
        if fixed is not None:
            _require_at_least_1(knob, fixed)
            return {f"min_{knob}": fixed, f"max_{knob}": fixed}
        _require_at_least_1(f"min_{knob}", lo)
        if hi is not None:  # 0 would silently mean "no bound"
            _require_at_least_1(f"max_{knob}", hi)
        return {f"min_{knob}": lo, f"max_{knob}": hi or 0}

    for flag in ("top", "max_micro_batch", "max_vpp", "min_nodes", "max_nodes"):
        if flags.get(flag) is not None:
            _require_at_least_1(flag, flags[flag])
    for flag in INT_FLAGS:
        if flags.get(flag) is not None and flags[flag] > MAX_INT_FLAG:
            raise LayoutError(f"--{flag.replace('_', '-')} {flags[flag]}: at most {MAX_INT_FLAG:,}")

    recompute = ("none",) if flags["no_recompute"] else tuple(flags["recompute"] or RECOMPUTE_MODES)
    sp = (False, True) if flags["sequence_parallel"] is None else (flags["sequence_parallel"],)
    orders = tuple(flags["order"] or DEFAULT_ORDERS)
    return Space(**bound("tp", flags["min_tp"], flags["max_tp"]), **bound("pp", flags["min_pp"], flags["max_pp"]),
                 **bound("dp", flags["min_dp"], flags["max_dp"]), **_cp_bounds(flags), **_ep_bounds(flags),
                 **bound("micro_batch", 1, max(flags["max_micro_batch"], flags["micro_batch"] or 1)),
                 **bound("vpp", 1, max(flags["max_vpp"], flags["vpp"] or 1)),
                 zero=tuple(flags["zero"] or (0, 1, 2, 3)), recompute=recompute, sequence_parallel=sp, orders=orders,
                 uneven=flags["uneven"], etp_fixed=_etp_flag(flags), schedules=tuple(flags.get("schedule") or ()))


def _etp_flag(flags: dict) -> int | None:
    if flags.get("etp") is not None:
        _require_at_least_1("etp", flags["etp"])
    return flags.get("etp")


def _cp_bounds(flags: dict) -> dict:
    """min_cp / max_cp of the flags; no --cp / --max-cp leaves max_cp None (the search's default
    bound, `Space.cp_bound`)."""
    if flags.get("cp") is None and flags.get("max_cp") is None:
        _require_at_least_1("min_cp", flags.get("min_cp", 1))
        return {"min_cp": flags.get("min_cp", 1)}
    lo, hi = flags.get("min_cp", 1), flags.get("max_cp")
    fixed = flags.get("cp")
    if fixed is not None:
        _require_at_least_1("cp", fixed)
        return {"min_cp": fixed, "max_cp": fixed}
    _require_at_least_1("min_cp", lo)
    _require_at_least_1("max_cp", hi)
    return {"min_cp": lo, "max_cp": hi}


def _ep_bounds(flags: dict) -> dict:
    """min_ep / max_ep of the flags; no --ep / --max-ep leaves max_ep None (the search's default
    bound, `Space.ep_bound`: the routed experts, or 1 for a dense model)."""
    fixed, lo, hi = flags.get("ep"), flags.get("min_ep", 1), flags.get("max_ep")
    if fixed is not None:
        _require_at_least_1("ep", fixed)
        return {"min_ep": fixed, "max_ep": fixed}
    _require_at_least_1("min_ep", lo)
    if hi is not None:
        _require_at_least_1("max_ep", hi)
    return {"min_ep": lo, "max_ep": hi}


MAX_INT_FLAG = 1_000_000_000  # no degree, batch or count is larger (and pp * vpp stays inside int64)
INT_FLAGS = ("top", "pick", "tp", "min_tp", "max_tp", "pp", "min_pp", "max_pp", "dp", "min_dp", "max_dp",
             "cp", "min_cp", "max_cp", "ep", "min_ep", "max_ep", "etp",
             "micro_batch", "max_micro_batch", "vpp", "max_vpp", "min_nodes", "max_nodes")


def _require_at_least_1(knob: str, value: int) -> None:
    if value < 1:
        raise LayoutError(f"--{knob.replace('_', '-')} must be >= 1, got {value}")


def _thresholds(min_mfu: float | None, max_memory_fraction: float | None) -> dict:
    if min_mfu is not None and not 0 <= min_mfu <= 1:
        raise LayoutError(f"--min-mfu {min_mfu}: give a fraction between 0 and 1 (e.g. 0.4)")
    if max_memory_fraction is not None and not 0 < max_memory_fraction <= 1:
        raise LayoutError(f"--max-memory-fraction {max_memory_fraction}: give a fraction in (0, 1] (e.g. 0.9)")
    return {"min_mfu": min_mfu, "max_memory_fraction": max_memory_fraction}


def _require_pick(report) -> None:
    """--pick names a row of the table: one of the distinct decisions (`plan3d.grouping`)."""
    pick, count = report.pick, len(report.decisions)
    if pick < 1 or (report.result.feasible_count and pick > count):
        raise LayoutError(f"--pick {pick}: choose 1..{max(count, 1)} (the rows of the ranked table, one per "
                          "distinct layout)")


def _no_fit(report, space, thresholds: dict, json_out: bool) -> None:
    """Show the nearest misses with what to change, then fail (exit 1)."""
    from plan3d.render import recommend as render
    from plan3d.search import nodes_to_fit

    result = report.result
    if result.size and report.sweep is None:
        report.nodes_needed = nodes_to_fit(result.cluster, result.model, result.training, space, **thresholds)
    if json_out:
        print(json_text(render.recommendation_dict(report, False)))
    else:
        render.print_recommendation(report, False)
    raise InfeasibleError(render.no_fit_message(report))


def _write_plan(result, row: int, out: Path) -> None:
    from plan3d.cost.estimate import estimate
    from plan3d.plan import build_plan, save_plan
    from plan3d.rankmap import require_loadable_plan

    layout = result.layout(row)
    require_loadable_plan(layout)
    est = estimate(result.cluster, result.model, result.training, layout, result.engine)
    save_plan(build_plan(result.cluster, result.model, result.training, layout, est.to_dict(), result.engine), out)


@app.command("explain")
def explain_cmd(
    cluster: ClusterOpt,
    model: ModelOpt,
    tp: Annotated[int, _opt("--tp", "Tensor-parallel degree.")] = 1,
    pp: Annotated[int, _opt("--pp", "Pipeline-parallel degree.")] = 1,
    dp: Annotated[IntOpt, _opt("--dp", "Data-parallel degree (default: fill the cluster).")] = None,
    cp: CpOpt = 1,
    ep: Annotated[int, _opt("--ep", "Expert-parallel degree (mixture-of-experts models).")] = 1,
    micro_batch: Annotated[int, _opt("--micro-batch", "Sequences per micro-batch.")] = 1,
    vpp: Annotated[int, _opt("--vpp", "Virtual pipeline stages per rank.")] = 1,
    schedule: ScheduleOpt = None,
    zero: Annotated[int, _opt("--zero", "ZeRO stage 0-3.")] = 0,
    recompute: Annotated[str, _opt("--recompute", "none, selective, moe-act, moe (Megatron-Core, MoE models), mla-up (Megatron-Core, MLA models), partial (Megatron-Core: the fewest layers per chunk that fit) or full.")] = "none",
    sequence_parallel: Annotated[bool, _opt("--sequence-parallel", "Megatron sequence parallelism.")] = False,
    order: Annotated[str, _opt("--order", "Rank order, first axis fastest.")] = "tp-cp-ep-dp-pp",
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = None,
    engine: EngineOpt = None,
    cp_comm: CpCommOpt = None,
    ep_dispatcher: EpDispatcherOpt = None,
    ep_overlap: EpOverlapOpt = None,
    act_offload: ActOffloadOpt = None,
    objective: ObjectiveOpt = "throughput",
    ranking_mode: RankingOpt = "expected",
    json_out: JsonOpt = False,
) -> None:
    """Why one layout ranks where it does, term by term against the best the engine can run."""
    from plan3d import ranking, search
    from plan3d.layout import check_layout
    from plan3d.render import recommend as render

    specs = load_specs(cluster, model, nodes, gpus_per_node, global_batch, seq_len, precision, gpu_memory)
    specs = (*specs[:2], with_precision(specs[2], specs[0].gpu, precision))
    engine_spec = load_engine_opt(engine, specs[0], cp_comm, specs[1], ep_dispatcher, ep_overlap, act_offload)
    world = specs[0].world_size
    if dp is None:  # a tp or pp below 1 is left for make_layout to reject
        dp = max(1, world // max(tp * pp * cp, 1))
    layout = make_layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, micro_batch=micro_batch, vpp=vpp, schedule=schedule, zero=zero,
                         recompute=recompute, sequence_parallel=sequence_parallel, order=order)
    problems = engine_spec.job_problems(layout, specs[1], specs[2])
    if problems:
        raise LayoutError("; ".join(problems))
    check_layout(layout, specs[1], specs[2], world)
    if layout.world_size != world:
        raise LayoutError(f"tp*pp*cp*dp = {layout.world_size} but the cluster has {world} GPUs: the search ranks "
                          f"layouts that use every GPU; pass --nodes {-(-layout.world_size // specs[0].gpus_per_node)} "
                          f"or degrees whose product is {world}")
    orders = tuple(dict.fromkeys(search.DEFAULT_ORDERS + (order,)))
    cp_bound = search.Space().cp_bound(specs[2].seq_len or specs[1].seq_len)
    space = search.Space(max_micro_batch=max(8, micro_batch), max_vpp=max(8, vpp), orders=orders,
                         max_cp=max(cp_bound, cp))
    result = search.search(*specs, space, engine=engine_spec)
    order_ = ranking.rank(result, objective, ranking_mode)
    row = result.find(layout)
    assert row is not None, "a valid layout inside the space is always evaluated"
    report = render.Explanation(result, order_, row, objective)
    if json_out:
        print(json_text(render.explanation_dict(report)))
    else:
        render.print_explanation(report)
