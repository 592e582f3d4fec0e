"""`plan3d rankmap`: who talks to whom, and where (issue 4)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

import plan3d.rankmap as ranks  # called as ranks.rankmap_for: tests replace it to see that a budget refuses first
from plan3d.cli.app import app
from plan3d.cli.common import ClusterOpt, GpnOpt, NodesOpt, OrderOpt, make_layout
from plan3d.errors import LayoutError, SpecError
from plan3d.layout import DEFAULT_ORDER, Layout
from plan3d.plan import rankmap_dict
from plan3d.rankmap import MAX_LISTED_RANKS, placement_warnings, placements
from plan3d.render import rankmap as render
from plan3d.render.units import json_text
from plan3d.specs.catalog import load_cluster, require_positive
from plan3d.specs.cluster import ClusterSpec

FORMATS = ("table", "json", "csv")
# Budgets, in ranks, so that every output comes back in seconds (issue 19):
MAX_RANKS = 1 << 20  # the table: a grid of the first nodes and one row per group kind (1 M ranks: ~1 s)
# MAX_LISTED_RANKS (plan3d.rankmap): json/csv list every rank, as a plan does (json: ~5 s, 37 MB)
MAX_SVG_RANKS = 4_096  # a picture of more nodes is unreadable (512 nodes of 8 GPUs is already 17,000 px tall)


@app.command("rankmap")
def rankmap(
    cluster: ClusterOpt,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")] = 1,
    dp: Annotated[Optional[int], typer.Option("--dp", help="Data-parallel degree (default: fill the cluster).")] = None,
    cp: Annotated[int, typer.Option("--cp", help="Context-parallel degree.")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel degree (carved out of dp*cp).")] = 1,
    etp: Annotated[Optional[int], typer.Option("--etp", help="Expert tensor-parallel degree (default tp): the "
                                               "expert groups fold ep*etp out of tp*cp*dp.")] = None,
    order: OrderOpt = DEFAULT_ORDER,
    nodes: NodesOpt = None,
    gpus_per_node: GpnOpt = None,
    fmt: Annotated[str, typer.Option("--format", help=(
        "table (the first nodes and every group kind), json or csv (every rank: at most 131,072 ranks)."))] = "table",
    svg: Annotated[Optional[Path], typer.Option("--svg", help="Also write an SVG picture here (at most 4,096 ranks).")] = None,
) -> None:
    """Rank <-> (tp, pp, dp) coordinates, node and GPU of every rank, every group and its tier."""
    if fmt not in FORMATS:
        raise SpecError("command line", [f"--format {fmt!r}: use one of {', '.join(FORMATS)}"])
    require_positive("nodes", nodes)
    require_positive("gpus_per_node", gpus_per_node)
    spec = load_cluster(cluster, nodes, gpus_per_node)
    layout = _fit_layout(spec, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, order=order)
    _require_budget(layout.world_size, fmt, svg is not None)
    rmap = ranks.rankmap_for(layout, spec.gpus_per_node)
    tiers = spec.tiers()
    facts, warnings, notes = placements(rmap, tiers), placement_warnings(rmap, tiers), _notes(spec, layout)
    if svg is not None:
        _write(svg, render.rankmap_svg(rmap, f"{spec.name}: {layout.short()}, order {layout.order}"))
        notes.append(f"wrote {svg}")
    if fmt == "json":
        payload = rankmap_dict(rmap) | {"cluster": spec.name, "placement": [vars(f) for f in facts],
                                        "warnings": warnings}
        print(json_text(payload))
    elif fmt == "csv":
        print(render.rankmap_csv(rmap), end="")
    else:
        render.print_rankmap(rmap, facts, notes, warnings)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as err:
        raise SpecError(str(path), [f"cannot be written ({err.strerror}); choose another --svg path"]) from err


def _fit_layout(spec: ClusterSpec, dp: int | None, **degrees) -> Layout:
    """The layout of the flags; dp fills the cluster when not given; too large -> LayoutError."""
    world = spec.world_size
    for name, value in (("tp", degrees["tp"]), ("pp", degrees["pp"]), ("cp", degrees["cp"]), ("dp", dp)):
        if value is not None and value <= 0:
            raise LayoutError(f"--{name} must be a positive integer, got {value}; e.g. {_example(spec, degrees)}")
    model_parallel = degrees["tp"] * degrees["pp"] * degrees["cp"]
    if dp is None:
        if world % model_parallel:
            raise LayoutError(f"tp*pp*cp = {model_parallel} does not divide the cluster's {world} GPUs, so dp cannot "
                              f"fill it; pass --dp or choose sizes that multiply to {world}, e.g. {_example(spec, degrees)}")
        dp = world // model_parallel
    layout = make_layout(dp=dp, **degrees)
    if layout.world_size > world:
        raise LayoutError(f"tp*pp*dp*cp = {layout.world_size} exceeds the cluster's {world} GPUs "
                          f"({spec.nodes} nodes x {spec.gpus_per_node}); choose sizes that multiply to {world} "
                          f"(e.g. {_example(spec, degrees)}) or raise --nodes")
    if layout.world_size > MAX_RANKS:
        raise LayoutError(f"{layout.world_size} ranks is more than a rank map shows (at most {MAX_RANKS}); "
                          "use fewer --nodes: the placement repeats node after node")
    return layout


def _require_budget(world: int, fmt: str, svg: bool) -> None:
    """Refuse, before building anything, an output larger than its budget (see MAX_LISTED_RANKS)."""
    if fmt != "table" and world > MAX_LISTED_RANKS:
        raise LayoutError(f"--format {fmt} lists every rank: {world:,} ranks is more than it writes (at most "
                          f"{MAX_LISTED_RANKS:,}, the largest real clusters); use fewer --nodes (the placement repeats "
                          "node after node) or the default --format table (the first nodes and every group kind)")
    if svg and world > MAX_SVG_RANKS:
        raise LayoutError(f"--svg draws every rank: {world:,} ranks is more than a readable picture (at most "
                          f"{MAX_SVG_RANKS:,}); use fewer --nodes (the placement repeats node after node) or "
                          "drop --svg and read the table's groups")


def _example(spec: ClusterSpec, degrees: dict) -> str:
    """A valid flag set for this cluster close to the requested one: tp fits a node, pp divides the rest."""
    gpn, world = spec.gpus_per_node, spec.world_size
    tp = max(1, min(degrees["tp"], gpn))
    while gpn % tp:
        tp -= 1
    pp = max(1, min(degrees["pp"], world // tp))
    while (world // tp) % pp:
        pp -= 1
    return f"--tp {tp} --pp {pp} --dp {world // (tp * pp)}"


def _notes(spec: ClusterSpec, layout: Layout) -> list[str]:
    if layout.world_size == spec.world_size:
        return []
    used_nodes = -(-layout.world_size // spec.gpus_per_node)
    return [f"the layout uses the first {layout.world_size} of the cluster's {spec.world_size} GPUs "
            f"(nodes 0-{used_nodes - 1} of {spec.nodes})"]
