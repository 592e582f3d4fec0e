"""Rich tables for `plan3d estimate`."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plan3d.render.engine import engine_line, provenance_lines
from plan3d.render.units import gib, ms, printable
from plan3d.vocab import MEMORY_TERMS, TIME_TERMS
from plan3d.specs.engine import ACT_OFFLOAD_MODULES

# the labels of the tables (and of `plots`), one per term of plan3d.vocab
MEMORY_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer states",
                 "activations": "activations", "buffers": "communication buffers",
                 "reserve": "reserve (context, NCCL, fragmentation)"}
TIME_LABELS = {"compute": "compute (forward + backward)", "recompute": "recompute",
               "bubble": "pipeline bubble", "tp_comm": "TP communication", "pp_comm": "PP communication",
               "ep_comm": "EP all-to-all (MoE dispatch/combine, exposed)",
               "offload": "activation offload to host (exposed)",
               "overhead": "host overhead (kernel launches)",
               "dp_comm": "DP communication (exposed)", "zero_comm": "ZeRO-3 gathers (exposed)",
               "optimizer": "optimizer step"}


def memory_table(est) -> Table:
    table = Table(title=f"memory of the most-loaded rank (pipeline rank {est.worst_pp_rank})")
    table.add_column("category")
    table.add_column("GiB", justify="right")
    for key in MEMORY_TERMS:
        label = MEMORY_LABELS[key]
        if key == "gradients" and est.grad_dtype:
            label = f"{label} ({est.grad_dtype} buffer)" if "+" not in est.grad_dtype else f"{label} ({est.grad_dtype})"
        table.add_row(label, gib(est.memory_bytes[key]))
    table.add_row("[bold]peak[/bold]", f"[bold]{gib(est.peak_memory_bytes)}[/bold]")
    table.add_row("usable capacity", gib(est.capacity_bytes))
    return table


def time_table(est) -> Table:
    table = Table(title="time of one step")
    table.add_column("category")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for key in TIME_TERMS:
        if key == "ep_comm" and est.layout.get("ep", 1) == 1 and not est.time_s[key]:
            continue  # no expert parallelism: no all-to-all row
        if key == "offload" and est.act_offload in ("", "none") and not est.time_s[key]:
            continue  # nothing offloaded: no offload row
        table.add_row(TIME_LABELS[key], ms(est.time_s[key]), f"{est.time_s[key] / est.step_time_s:.1%}")
    table.add_row("[bold]step[/bold]", f"[bold]{ms(est.step_time_s)}[/bold]", "100%")
    return table


def summary_lines(est, cluster, model, training) -> list[str]:
    fits = "[green]fits[/green]" if est.fits else "[red]does NOT fit[/red]"
    stages = ", ".join(f"{b / 2**30:.1f}" for b in est.stage_memory_bytes)
    return [
        printable(f"{model.name} on {cluster.name}: {_layout_text(est.layout, est.cp_comm, est.recompute_layers, est.ep_dispatcher, est.ep_overlap, est.act_offload)}, global batch {training.global_batch}"),
        *host_offload_lines(est, cluster),
        "groups span: " + ", ".join(f"{group.replace('_', 'x')} {tier}" for group, tier in est.tiers.items()),
        f"step {ms(est.step_time_s)}{band_text(est)}, {est.tokens_per_s:,.0f} tokens/s, "
        f"{est.model_tflops_per_gpu:.1f} model TFLOP/s per GPU, bubble {est.bubble_fraction:.1%}",
        f"MFU {est.mfu:.1%} (causal attention: half the s^2 term), {est.mfu_noncausal:.1%} counting attention "
        f"non-causally, HFU {est.hfu:.1%} (hardware FLOPs: non-causal, with the recompute pass)",
        *region_lines(est),
        f"memory: {fits} ({gib(est.peak_memory_bytes)} of {gib(est.capacity_bytes)}); per pipeline rank GiB: {stages}",
    ]


def band_text(est) -> str:
    """' (band 35.0 s-56.2 s)': where 80% of published runs like it measured (plan3d.cost.bands)."""
    if not est.step_time_s_band:
        return ""
    lo, hi = est.step_time_s_band
    return f" (band {ms(lo)}-{ms(hi)}, {'validated' if est.validated else '[yellow]extrapolated[/yellow]'})"


def region_lines(est) -> list[str]:
    """The band's region: the runs behind it, and each feature it is extrapolated on."""
    region = est.region
    if not region:
        return []
    trust = "validated" if region["validated"] else "extrapolated"
    if "made_of" in region:  # Band.makeup: the runs, the noise and each prior, as they compound
        return [escape(f"band: {region['name']} ({trust}): {region['made_of']}")]
    lo, hi = region["error_pct"]  # a plan written before bands said what they are made of
    runs = (f"{region['runs']} left-out published runs ({', '.join(region['sources'])})" if region["runs"]
            else "no measured run")
    lines = [escape(f"band: {region['name']}: prediction error {lo:+.0f}% to {hi:+.0f}% (80% of {runs})")]
    return lines + [escape(f"extrapolated: {why}") for why in region["extrapolated"]]


def host_offload_lines(est, cluster) -> list[str]:
    """The host memory the offloaded activations take, per GPU and per node (none without offloading)."""
    if est.act_offload in ("", "none"):
        return []
    per_gpu = est.host_offload_bytes
    return [f"host memory: {gib(per_gpu)} of offloaded activations per GPU ({gib(per_gpu * cluster.gpus_per_node)} "
            f"pinned per node of {cluster.gpus_per_node} GPUs), copied at {cluster.gpu.host_link_gbytes_per_s:g} GB/s "
            "each way (GPUSpec.host_link_gbytes_per_s)"]


def _layout_text(layout: dict, cp_comm: str = "", recompute_layers: int = 0, ep_dispatcher: str = "",
                 ep_overlap: str = "", act_offload: str = "") -> str:
    cp = [f"cp {layout['cp']}" + (f" ({cp_comm} K/V exchange)" if cp_comm else "")] if layout.get("cp", 1) > 1 else []
    how = [f"{ep_dispatcher} dispatcher"] * bool(ep_dispatcher) + [f"{ep_overlap} overlap"] * (ep_overlap not in ("", "none"))
    ep = [f"ep {layout['ep']}" + (f" ({', '.join(how)})" if how else "")] if layout.get("ep", 1) > 1 else []
    parts = [f"tp {layout['tp']}", f"pp {layout['pp']}", f"dp {layout['dp']}", *cp, *ep, f"micro-batch {layout['micro_batch']}"]
    if layout["vpp"] > 1:
        parts.append(f"vpp {layout['vpp']}")
    if layout.get("schedule"):
        parts.append(f"schedule {layout['schedule']}")
    recompute = f"recompute {layout['recompute']}"
    if layout["recompute"] == "partial":
        recompute += (f" (the first {recompute_layers} layer{'s' if recompute_layers != 1 else ''} of each virtual chunk)"
                      if recompute_layers else " (nothing to recompute: fits without, runs as none)")
    parts += [f"ZeRO {layout['zero']}", recompute]
    if act_offload not in ("", "none"):
        modules = ' '.join(ACT_OFFLOAD_MODULES[act_offload])
        parts.append(f"{act_offload} activations offloaded ({modules}; the expert modules in MoE layers only)"
                     if act_offload == "all" else f"{act_offload} activations offloaded ({modules})")
    if layout["sequence_parallel"]:
        parts.append("sequence parallel")
    return ", ".join(parts) + f", order {layout['order']}"


def print_estimate(est, cluster, model, training, engine=None) -> None:
    console = Console()
    if engine is not None:
        console.print(engine_line(engine))
    for line in summary_lines(est, cluster, model, training):
        console.print(line)
    console.print(memory_table(est))
    console.print(time_table(est))
    for line in provenance_lines(est.provenance):
        console.print(line)
    for warning in est.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
