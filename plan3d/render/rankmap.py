"""Pictures of a rank map: a rich node x GPU grid, CSV rows and a hand-written SVG.

Cells show each rank's (tp, pp, dp) coordinates (cp and ep when > 1) and are coloured by
pipeline stage; the SVG outlines each TP group. No formula lives here: placement facts come
from `plan3d.rankmap.placements`.
"""
from __future__ import annotations

import csv
import io
from xml.sax.saxutils import escape

from rich.console import Console
from rich.table import Table

from plan3d.rankmap import GroupPlacement, RankCoord, RankMap

CSV_FIELDS = ("rank", "node", "local_rank", "tp", "pp", "dp", "cp", "ep")
STAGE_STYLES = ("on dark_blue", "on dark_green", "on dark_red", "on purple4", "on dark_orange3",
                "on deep_sky_blue4", "on dark_olive_green3", "on magenta3")
MAX_TABLE_NODES = 32
MAX_LISTED_GROUPS = 3


def cell_label(coord: RankCoord, show_cp: bool, show_ep: bool, sep: str = " ") -> str:
    parts = [f"t{coord.tp}", f"p{coord.pp}", f"d{coord.dp}"]
    parts += [f"c{coord.cp}"] * show_cp + [f"e{coord.ep}"] * show_ep
    return sep.join(parts)


def _node_count(rankmap: RankMap) -> int:
    return -(-rankmap.world_size // rankmap.gpus_per_node)


def _grid_rows(rankmap: RankMap, max_nodes: int | None = None) -> list[list[RankCoord | None]]:
    """Coordinates per node and local GPU (the first `max_nodes` nodes when given); None where the
    layout leaves a GPU idle."""
    gpn = rankmap.gpus_per_node
    nodes = _node_count(rankmap) if max_nodes is None else min(max_nodes, _node_count(rankmap))
    rows: list[list[RankCoord | None]] = [[None] * gpn for _ in range(nodes)]
    for coord in rankmap.all_coords(limit=nodes * gpn):
        rows[coord.node][coord.local_rank] = coord
    return rows


def grid_table(rankmap: RankMap, max_nodes: int = MAX_TABLE_NODES) -> Table:
    layout = rankmap.layout
    table = Table(title=f"rank map tp{layout.tp} pp{layout.pp} dp{layout.dp} cp{layout.cp} ep{layout.ep}, "
                        f"order {rankmap.order} (cell: rank, then t=tp p=pp d=dp coordinates; colour: pp stage)",
                  padding=(0, 0))
    table.add_column("node", justify="right", style="bold", no_wrap=True, min_width=4)
    for gpu in range(rankmap.gpus_per_node):
        table.add_column(f"gpu{gpu}", justify="center", no_wrap=True)
    rows, node_count = _grid_rows(rankmap, max_nodes), _node_count(rankmap)
    for node, row in enumerate(rows):
        cells = [("idle" if c is None else
                  f"[{STAGE_STYLES[c.pp % len(STAGE_STYLES)]}]r{c.rank}\n{cell_label(c, layout.cp > 1, layout.ep > 1, '')}[/]")
                 for c in row]
        table.add_row(str(node), *cells)
    if node_count > max_nodes:
        table.add_row("...", *[""] * rankmap.gpus_per_node)
        table.caption = f"{node_count - max_nodes} more nodes not shown; use --format json or csv for every rank"
    return table


def group_text(members: list[int]) -> str:
    """[0,1,2,3] -> '[0..3]', [0,4,8,12] -> '[0..12 step 4]' (evenly spaced), else the full list."""
    steps = {b - a for a, b in zip(members, members[1:])}
    if len(members) > 3 and len(steps) == 1:
        step = steps.pop()
        return f"[{members[0]}..{members[-1]}" + (f" step {step}]" if step != 1 else "]")
    return "[" + ",".join(map(str, members)) + "]"


def groups_table(rankmap: RankMap, facts: list[GroupPlacement]) -> Table:
    trivial = [f.name for f in facts if f.size == 1 and f.name not in ("tp", "pp", "dp")]
    table = Table(title="groups (a group holds the ranks that differ only along its axes)",
                  caption=f"groups of one rank not shown: {', '.join(trivial)}" if trivial else None)
    for column in ("group", "size", "count", "nodes/group", "tier", "first groups"):
        table.add_column(column)
    for fact in facts:
        if fact.name in trivial:
            continue
        shown = rankmap.group_array(fact.name)[:MAX_LISTED_GROUPS].tolist()
        more = " ..." if fact.count > MAX_LISTED_GROUPS else ""
        table.add_row(fact.name, str(fact.size), str(fact.count), str(fact.nodes_spanned), fact.tier_name,
                      " ".join(group_text(g) for g in shown) + more)
    return table


def print_rankmap(rankmap: RankMap, facts: list[GroupPlacement], notes: list[str], warnings: list[str]) -> None:
    console = Console()
    console.print(grid_table(rankmap))
    console.print(groups_table(rankmap, facts))
    for note in notes:
        console.print(f"note: {note}")
    for warning in warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")


def rankmap_csv(rankmap: RankMap) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for coord in rankmap.all_coords():
        writer.writerow([getattr(coord, field) for field in CSV_FIELDS])
    return out.getvalue()


# ---- SVG ---------------------------------------------------------------------------------
CELL_W, CELL_H, MARGIN, LABEL_W = 78, 34, 10, 52
LEGEND_MIN_W = 700  # room for the legend's longest line
SVG_FILLS = ("#4e79a7", "#59a14f", "#e15759", "#b07aa1", "#f28e2b", "#76b7b2", "#edc948", "#ff9da7",
             "#9c755f", "#bab0ac")


def _tp_index(rankmap: RankMap) -> dict[int, int]:
    return {rank: index for index, members in enumerate(rankmap.groups("tp")) for rank in members}


def _cell_xy(node: int, gpu: int) -> tuple[int, int]:
    return MARGIN + LABEL_W + gpu * CELL_W, MARGIN + 20 + node * CELL_H


def _svg_cells(rankmap: RankMap, rows: list[list[RankCoord | None]]) -> list[str]:
    parts = []
    layout = rankmap.layout
    for node, row in enumerate(rows):
        y = _cell_xy(node, 0)[1]
        parts.append(f'<text x="{MARGIN}" y="{y + CELL_H // 2 + 4}" class="n">node {node}</text>')
        for gpu, coord in enumerate(row):
            x, _ = _cell_xy(node, gpu)
            fill = "#eeeeee" if coord is None else SVG_FILLS[coord.pp % len(SVG_FILLS)]
            parts.append(f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" fill="{fill}" stroke="#ffffff"/>')
            text = "idle" if coord is None else f"{coord.rank}: {cell_label(coord, layout.cp > 1, layout.ep > 1)}"
            parts.append(f'<text x="{x + CELL_W // 2}" y="{y + CELL_H // 2 + 4}" class="c">{escape(text)}</text>')
    return parts


def _svg_tp_outlines(rankmap: RankMap, rows: list[list[RankCoord | None]]) -> list[str]:
    """A thick edge wherever two neighbouring cells belong to different TP groups (or none)."""
    tp_of = _tp_index(rankmap)
    group = [[None if c is None else tp_of[c.rank] for c in row] for row in rows]
    nodes, gpn = len(rows), rankmap.gpus_per_node
    parts = []
    for node in range(nodes):
        for gpu in range(gpn):
            mine = group[node][gpu]
            if mine is None:
                continue
            x, y = _cell_xy(node, gpu)
            edges = ((gpu == 0 or group[node][gpu - 1] != mine, (x, y, x, y + CELL_H)),
                     (gpu == gpn - 1 or group[node][gpu + 1] != mine, (x + CELL_W, y, x + CELL_W, y + CELL_H)),
                     (node == 0 or group[node - 1][gpu] != mine, (x, y, x + CELL_W, y)),
                     (node == nodes - 1 or group[node + 1][gpu] != mine, (x, y + CELL_H, x + CELL_W, y + CELL_H)))
            parts += [f'<line x1="{a}" y1="{b}" x2="{c}" y2="{d}" class="tp"/>' for edge, (a, b, c, d) in edges if edge]
    return parts


LEGEND_LINE = 18
SWATCH_W = 58
LEGEND_H = 2 * LEGEND_LINE + 26  # three rows: cell text, stage colours, TP outline


def _svg_legend(rankmap: RankMap, top: int) -> list[str]:
    """A `<g id="legend">`: what a cell's text means (every axis named with its size), one swatch
    per pipeline stage colour, and the TP-group outline."""
    layout = rankmap.layout
    sizes = ", ".join(f"{axis}={getattr(layout, axis)}" for axis in ("tp", "pp", "dp", "cp", "ep"))
    shown = "t=tp, p=pp, d=dp" + ", c=cp" * (layout.cp > 1) + ", e=ep" * (layout.ep > 1)
    x, y = MARGIN, top + LEGEND_LINE
    parts = ['<g id="legend">',
             f'<text x="{x}" y="{y}" class="l">cell: rank: {shown} coordinates; sizes {escape(sizes)}, '
             f'order {escape(rankmap.order)} (first varies fastest)</text>']
    y += 8
    repeat = _colour_repeat(layout.pp)
    parts.append(f'<text x="{x}" y="{y + 11}" class="l">colour: pipeline stage{escape(repeat)}</text>')
    for stage in range(min(layout.pp, len(SVG_FILLS))):
        sx = _swatch_x(stage, repeat)
        parts += [f'<rect x="{sx}" y="{y}" width="14" height="14" fill="{SVG_FILLS[stage]}" class="swatch"/>',
                  f'<text x="{sx + 18}" y="{y + 11}" class="l">pp {stage}</text>']
    y += 14 + LEGEND_LINE
    parts += [f'<line x1="{x}" y1="{y - 4}" x2="{x + 30}" y2="{y - 4}" class="tp"/>',
              f'<text x="{x + 38}" y="{y}" class="l">outline: one tensor-parallel (tp) group of {layout.tp} '
              f'rank{"s" * (layout.tp > 1)}</text>', "</g>"]
    return parts


def _colour_repeat(pp: int) -> str:
    return f" (repeats every {len(SVG_FILLS)})" if pp > len(SVG_FILLS) else ""


def _swatch_x(stage: int, repeat: str) -> int:
    return MARGIN + 150 + 7 * len(repeat) + stage * SWATCH_W


def _svg_width(rankmap: RankMap) -> int:
    grid = 2 * MARGIN + LABEL_W + rankmap.gpus_per_node * CELL_W
    stages = min(rankmap.layout.pp, len(SVG_FILLS))
    swatches = _swatch_x(stages, _colour_repeat(rankmap.layout.pp)) + MARGIN
    return max(grid, swatches, LEGEND_MIN_W)


def rankmap_svg(rankmap: RankMap, title: str) -> str:
    """The cluster grid (nodes x GPUs) coloured by pipeline stage, each TP group outlined, a legend below."""
    rows = _grid_rows(rankmap)
    grid_bottom = MARGIN + 20 + len(rows) * CELL_H
    width = _svg_width(rankmap)
    height = grid_bottom + LEGEND_H + MARGIN
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
            "<style>.c{font-size:11px;fill:#fff;text-anchor:middle}.n{font-size:11px;fill:#333}"
            ".tp{stroke:#111;stroke-width:3}.t{font-size:13px;fill:#111}.l{font-size:11px;fill:#333}</style>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
            f'<text x="{MARGIN}" y="{MARGIN + 10}" class="t">{escape(title)}</text>']
    body = _svg_cells(rankmap, rows) + _svg_tp_outlines(rankmap, rows) + _svg_legend(rankmap, grid_bottom)
    return "\n".join(head + body + ["</svg>"]) + "\n"
