"""RankMap against an independent naive implementation, Megatron-LM's published examples, and placement."""
from __future__ import annotations

import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest

from plan3d.layout import AXES, Layout
from plan3d.rankmap import RankMap, placement_warnings, placements
from plan3d.specs.catalog import load_cluster

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
DENSE_GROUPS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
                "dp_cp": ("cp", "dp"), "tp_cp": ("tp", "cp"), "mp": ("tp", "pp")}


# ---- the naive reference: nested loops over coordinates, no numpy ------------------------------
def naive_rank(coord: dict[str, int], sizes: dict[str, int], order: list[str]) -> int:
    rank, stride = 0, 1
    for axis in order:  # first axis varies fastest
        rank += coord[axis] * stride
        stride *= sizes[axis]
    return rank


def fastest_first(axes: list[str], sizes: dict[str, int]):
    """Every coordinate assignment of `axes`, axes[0] changing fastest."""
    for values in itertools.product(*[range(sizes[a]) for a in reversed(axes)]):
        yield dict(zip(reversed(axes), values))


def naive_groups(sizes: dict[str, int], order: list[str], names: tuple[str, ...]) -> list[list[int]]:
    outer = [a for a in order if a not in names]
    inner = [a for a in order if a in names]
    groups = []
    for fixed in fastest_first(outer, sizes):
        groups.append([naive_rank(fixed | moving, sizes, order) for moving in fastest_first(inner, sizes)])
    return groups


SHAPES = [  # (tp, cp, dp, pp, ep)
    (1, 1, 1, 1, 1), (2, 1, 2, 2, 1), (4, 1, 2, 3, 1), (3, 2, 2, 1, 1), (2, 2, 3, 2, 1),
    (1, 1, 6, 1, 3), (2, 1, 4, 2, 2), (2, 2, 2, 2, 4), (8, 1, 1, 2, 1), (1, 3, 1, 4, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}cp{}dp{}pp{}ep{}".format(*s))
def test_groups_and_coords_match_naive_for_every_order(shape):
    tp, cp, dp, pp, ep = shape
    for order in ORDERS:
        axes = order.split("-")
        rmap = RankMap(Layout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, order=order), gpus_per_node=4)
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        for name, names in DENSE_GROUPS.items():
            assert rmap.groups(name) == naive_groups(dense, axes, names), (order, name)
        expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
        assert rmap.groups("ep") == naive_groups(expert, axes, ("ep",)), order
        assert rmap.groups("edp") == naive_groups(expert, axes, ("dp",)), order
        for coord in fastest_first(axes, dense):
            rank = naive_rank(coord, dense, axes)
            got = rmap.coords(rank)
            assert (got.tp, got.cp, got.dp, got.pp) == (coord["tp"], coord["cp"], coord["dp"], coord["pp"])
            assert (got.node, got.local_rank) == (rank // 4, rank % 4)
            assert rmap.rank_of(tp=coord["tp"], pp=coord["pp"], dp=coord["dp"], cp=coord["cp"]) == rank


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tp{}cp{}dp{}pp{}ep{}".format(*s))
def test_every_group_kind_partitions_the_world(shape):
    tp, cp, dp, pp, ep = shape
    rmap = RankMap(Layout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep), gpus_per_node=8)
    for name in rmap.group_names:
        if name == "embedding":
            continue  # first and last stage only: not a partition
        members = sorted(r for group in rmap.groups(name) for r in group)
        assert members == list(range(rmap.world_size)), name
    for rank in range(rmap.world_size):  # a rank's ep coordinate is its position in its ep group
        group = next(g for g in rmap.groups("ep") if rank in g)
        assert rmap.coords(rank).ep == group.index(rank)


def test_embedding_group_is_first_and_last_stage():
    rmap = RankMap(Layout(tp=2, pp=4, dp=2), gpus_per_node=8)
    for pp_group, emb in zip(rmap.groups("pp"), rmap.groups("embedding")):
        assert emb == [pp_group[0], pp_group[-1]]
        assert [rmap.coords(r).pp for r in emb] == [0, 3]


# ---- Megatron-LM's published examples -------------------------------------------------------------
def test_megatron_initialize_model_parallel_docstring_example():
    """NVIDIA/Megatron-LM megatron/core/parallel_state.py, `initialize_model_parallel` docstring:
    16 GPUs g0..g15, tensor parallel 2, pipeline parallel 4 (so data parallel 2), default order."""
    rmap = RankMap(Layout(tp=2, pp=4, dp=2), gpus_per_node=8)
    assert rmap.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert rmap.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert rmap.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_megatron_context_parallel_docstring_example():
    """Same docstring, `context_parallel_size`: 8 GPUs, tp 4, cp 2 -> cp groups
    [GPU0, GPU4], [GPU1, GPU5], [GPU2, GPU6], [GPU3, GPU7]."""
    rmap = RankMap(Layout(tp=4, cp=2), gpus_per_node=8)
    assert rmap.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_generate_masked_orthogonal_rank_groups_docstring_examples():
    """Same file, `generate_masked_orthogonal_rank_groups` docstring: [tp, dp, pp] = [2, 3, 4] with the
    dp mask gives dp_group[0] = [0, 2, 4], dp_group[1] = [1, 3, 5], dp_group[7] = [19, 21, 23]; and with
    order 'tp-pp-dp', sizes 2-2-2, the dp groups are [[0, 4], [1, 5], [2, 6], [3, 7]]."""
    dp_groups = RankMap(Layout(tp=2, dp=3, pp=4), gpus_per_node=8).groups("dp")
    assert (dp_groups[0], dp_groups[1], dp_groups[7]) == ([0, 2, 4], [1, 3, 5], [19, 21, 23])
    tp_pp_dp = RankMap(Layout(tp=2, pp=2, dp=2, order="tp-cp-ep-pp-dp"), gpus_per_node=8)
    assert tp_pp_dp.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ---- placement on real clusters -------------------------------------------------------------------
def test_gb200_nvl72_tp_across_trays_stays_on_nvlink():
    cluster = load_cluster("gb200-nvl72")
    assert cluster.gpus_per_node == 4
    tiers = cluster.tiers()
    rmap = RankMap(Layout(tp=8, dp=9, pp=4), cluster.gpus_per_node)  # 288 GPUs, 4 racks
    assert rmap.nodes_spanned("tp") == 2 and rmap.tier_index("tp", tiers) == 0
    assert rmap.nodes_spanned("dp") == 9 and rmap.tier_index("dp", tiers) == 0  # 72 GPUs: one rack
    assert rmap.tier_index("pp", tiers) == 1  # stages 72 ranks apart: one per rack
    assert placement_warnings(rmap, tiers) == []
    assert rmap.warnings()  # the node-only view would have complained


def test_gb200_nvl72_tp_beyond_the_rack_leaves_nvlink():
    cluster = load_cluster("gb200-nvl72")
    rmap = RankMap(Layout(tp=144, dp=2), cluster.gpus_per_node)
    assert rmap.tier_index("tp", cluster.tiers()) == 1 and rmap.nodes_spanned("tp") == 36
    assert "spans 36 nodes" in placement_warnings(rmap, cluster.tiers())[0]


@pytest.mark.parametrize("name", ["dgx-a100-80g", "dgx-h100"])
def test_dgx_placement(name):
    cluster = load_cluster(name, nodes=8)
    tiers = cluster.tiers()
    rmap = RankMap(Layout(tp=8, pp=4, dp=2), cluster.gpus_per_node)
    assert (rmap.nodes_spanned("tp"), rmap.tier_index("tp", tiers)) == (1, 0)
    assert (rmap.nodes_spanned("pp"), rmap.tier_index("pp", tiers)) == (4, 1)
    assert placement_warnings(rmap, tiers) == []
    # dp=8 is not "inside a node" by size: with dp outermost, its 8 ranks sit on 8 nodes
    outer_dp = RankMap(Layout(pp=8, dp=8, order="tp-cp-ep-pp-dp"), cluster.gpus_per_node)
    assert (outer_dp.nodes_spanned("dp"), outer_dp.tier_index("dp", tiers)) == (8, 1)
    wide_tp = RankMap(Layout(tp=16, dp=4), cluster.gpus_per_node)
    assert (wide_tp.nodes_spanned("tp"), wide_tp.tier_index("tp", tiers)) == (2, 1)
    assert "TP group spans 2 nodes" in placement_warnings(wide_tp, tiers)[0]


def test_placements_report_every_group_kind():
    cluster = load_cluster("dgx-h100", nodes=2)
    rmap = RankMap(Layout(tp=4, pp=2, dp=2), cluster.gpus_per_node)
    facts = {f.name: f for f in placements(rmap, cluster.tiers())}
    assert set(facts) == set(rmap.group_names)
    assert (facts["mp"].size, facts["mp"].count, facts["mp"].tier_name) == (8, 2, cluster.tiers()[1].name)
    assert facts["tp"].tier_name == cluster.tiers()[0].name


# ---- no hidden "8 GPUs per node" ----------------------------------------------------------------
HARD_CODED_8 = {"//", "%", "<=", ">=", "<", ">", "==", "!=", "*"}


def test_no_hard_coded_eight_gpus_per_node_in_the_package():
    """`rank // 8`, `% 8`, `size <= 8` and the like: the node width comes from the cluster spec."""
    offenders = []
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("plan3d").rglob("*.py")):
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for before, token in zip(tokens, tokens[1:]):
            if (token.type == tokenize.NUMBER and token.string == "8" and before.type == tokenize.OP
                    and before.string in HARD_CODED_8 and not re.search(r"bits?|byte", token.line, re.I)):
                offenders.append(f"{path.name}:{token.start[0]}: {token.line.strip()}")
    assert offenders == []


def test_rankmap_warnings_with_tiers_know_the_nvlink_domain():
    gb200, dgx = load_cluster("gb200-nvl72"), load_cluster("dgx-h100", nodes=2)
    rmap = RankMap(Layout(tp=8, dp=36), gb200.gpus_per_node)
    assert rmap.warnings() and rmap.warnings(gb200.tiers()) == []
    wide = RankMap(Layout(tp=16), dgx.gpus_per_node)
    assert "spans 2 nodes" in wide.warnings(dgx.tiers())[0]


# ---- how the tables print a group ------------------------------------------------------------
def read_group_text(text: str) -> list[int]:
    """Parse what `group_text` prints back into members; only the documented spellings parse."""
    ranged = re.fullmatch(r"\[(\d+)\.\.(\d+)(?: step (\d+))?\]", text)
    if ranged:
        first, last, step = int(ranged[1]), int(ranged[2]), int(ranged[3] or 1)
        return list(range(first, last + 1, step))
    listed = re.fullmatch(r"\[(\d+(?:,\d+)*)\]", text)
    assert listed, f"{text!r} is neither a range nor a list"
    return [int(x) for x in listed[1].split(",")]


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "pp-dp-tp-cp-ep", "dp-tp-cp-ep-pp"])
def test_printed_groups_read_back_as_their_members(order):
    from plan3d.render.rankmap import group_text

    rankmap = RankMap(Layout(tp=4, pp=4, dp=2, order=order), gpus_per_node=8)
    for name in ("tp", "pp", "dp", "mp"):
        for members in rankmap.groups(name):
            text = group_text(members)
            assert read_group_text(text) == members, (name, members, text)
            assert "step 1" not in text


@pytest.mark.parametrize("name, nodes", [("dgx-h100", 4), ("gb200-nvl72", 18), ("gb200-nvl72", 36),
                                        ("dgx-a100-80g", 1)])
def test_calibrate_files_each_measured_group_under_the_tier_its_rank_map_group_crosses(name, nodes):
    """`plan3d calibrate` measures groups of n neighbouring ranks and groups of one rank per node;
    those are the tp groups of tp=n and the dp groups of tp=gpus_per_node. The tier it files each
    under must be the one the cost model prices that group on (RankMap.tier_index)."""
    from plan3d.calibrate import collective_groups

    cluster = load_cluster(name, nodes=nodes)
    world, per_node = cluster.world_size, cluster.gpus_per_node
    kinds = collective_groups(cluster, world)
    assert len(kinds) > 1
    for kind in kinds:
        members = kind["members"]
        size = len(members[0])
        across_nodes = members[0][1] - members[0][0] == per_node
        layout = Layout(tp=per_node, dp=world // per_node) if across_nodes else Layout(tp=size, dp=world // size)
        group = "dp" if across_nodes else "tp"
        rmap = RankMap(layout, per_node)
        assert rmap.groups(group) == members
        assert kind["tier"] == rmap.tier_index(group, cluster.tiers()), (name, size, across_nodes)
    if name == "gb200-nvl72":  # one rank per 4-GPU tray: NVLink within a 72-GPU rack, the outer tier beyond
        assert kinds[-1]["tier"] == (0 if world <= 72 else 1) and kinds[0]["tier"] == 0
