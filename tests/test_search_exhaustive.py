"""The vectorised search equals a plain exhaustive loop over Layout + layout_problems + estimate().

The loop below shares nothing with plan3d.search but the ranking function: it enumerates every
knob combination with itertools, builds each Layout, asks layout_problems, drops an order whose
rank map (groups from plan3d.rankmap) equals an earlier order's, and calls the scalar estimate().
"""
import itertools

import numpy as np
import pytest

from plan3d import ranking
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout, layout_problems, recompute_modes, recompute_problems
from plan3d.rankmap import rankmap_for
from plan3d.search import SearchResult, Space, balanced_split, layout_row, search
from plan3d.vocab import RECOMPUTE_MODES
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec
from test_search_space import first_code

SPACE = Space(max_micro_batch=3, max_vpp=3, uneven=False)
UNEVEN = Space(max_micro_batch=2, max_vpp=3, uneven=True)
CASES = [  # (cluster, nodes, model, global batch, seq len, space)
    ("dgx-a100-80g", 1, "tiny-gpt", 16, None, SPACE),
    ("dgx-a100-80g", 2, "llama3-8b", 32, 4096, SPACE),
    ("dgx-a100-40g", 2, "gpt-neox-20b", 24, None, SPACE),
    ("dgx-a100-80g", 1, "tiny-gpt", 24, None, UNEVEN),
]


def placement(layout: Layout, gpus_per_node: int):
    rmap = rankmap_for(layout, gpus_per_node)
    return tuple(tuple(map(tuple, rmap.groups(g))) for g in ("tp", "pp", "dp"))


def exhaustive(cluster, model, training, space: Space):
    """Every layout, one at a time: (rows, metrics, rejected counts by reason code, considered)."""
    world = cluster.world_size
    rows, metrics, rejected, considered = [], [], {}, 0
    triples = [(t, p, world // (t * p)) for t in range(1, world + 1) for p in range(1, world + 1)
               if world % (t * p) == 0]
    knobs = itertools.product(triples, range(1, space.max_micro_batch + 1), range(1, space.max_vpp + 1),
                              (False, True), space.zero, space.recompute)
    for (tp, pp, dp), mb, vpp, sp, zero, rc in knobs:
        if recompute_problems(rc, model, training):
            continue  # a mode the model rules out (moe-act on a dense model) is not searched at all
        seen = []
        for order in space.orders:
            try:
                layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, vpp=vpp, sequence_parallel=sp, zero=zero,
                                recompute=rc, order=order)
            except ValueError:
                continue  # not a layout at all (vpp without pp, sp without tp): not counted
            considered += 1
            code = first_code(layout, model, training, world)
            if space.uneven and code == 4:
                layout = Layout(**(layout.model_dump() | {"pp_layers": balanced_split(model.layers, pp * vpp)}))
                code = first_code(layout, model, training, world)
            if code:
                assert layout_problems(layout, model, training, world)  # a code comes with its sentence
                rejected[code] = rejected.get(code, 0) + 1
                continue
            where = placement(layout, cluster.gpus_per_node)
            if where in seen:
                rejected[13] = rejected.get(13, 0) + 1
                continue
            seen.append(where)
            if zero > 0 and dp == 1:
                rejected[14] = rejected.get(14, 0) + 1
                continue
            est = estimate(cluster, model, training, layout)
            if rc == "partial" and est.recompute_layers == 0:
                rejected[22] = rejected.get(22, 0) + 1  # partial recompute with no layer to recompute: runs as none
                continue
            rows.append(layout_row(layout, space.orders))
            metrics.append(scalar_metrics(est.to_dict()))
    return rows, metrics, rejected, considered


def scalar_metrics(d: dict) -> dict:
    out = {k: d[k] for k in ("step_time_s", "tokens_per_s", "peak_memory_bytes", "capacity_bytes", "fits", "mfu",
                             "model_tflops_per_gpu", "bubble_fraction", "recompute_layers")}
    out.update({f"{k}_s": v for k, v in d["time_s"].items()})
    out["step_band_low_s"], out["step_band_high_s"] = d["step_time_s_band"]  # each estimate's own band
    out["band_tier"] = len(d["region"]["extrapolated"])
    return out


def as_result(cluster, model, training, rows, metrics, space) -> SearchResult:
    layouts = {k: np.array([r[k] for r in rows]) for k in rows[0]}
    arrays = {k: np.array([m[k] for m in metrics]) for k in metrics[0]}
    codes = np.where(arrays["fits"], 0, 10).astype(np.int8)
    return SearchResult(cluster, model, training, space.orders, layouts, arrays, considered=0, rejected={},
                        seconds=1.0, codes=codes)


@pytest.fixture(scope="module", params=CASES, ids=[f"{c[2]}{'-uneven' * c[5].uneven}" for c in CASES])
def pair(request):
    name, nodes, model_name, batch, seq, space = request.param
    cluster, model = load_cluster(name, nodes), load_model(model_name)
    training = TrainingSpec(global_batch=batch, seq_len=seq)
    fast = search(cluster, model, training, space)
    rows, metrics, rejected, considered = exhaustive(cluster, model, training, space)
    if space.uneven:
        assert any(r["uneven"] for r in rows), "the uneven case should contain uneven layouts"
    return fast, as_result(cluster, model, training, rows, metrics, space), rejected, considered


def test_same_counts_and_reasons(pair):
    fast, slow, rejected, considered = pair
    assert fast.considered == considered
    assert fast.size == slow.size
    assert fast.feasible_count == slow.feasible_count > 0
    fast_rejected = {c: n for c, n in fast.rejected.items() if n and c != 10}
    assert fast_rejected == rejected
    assert fast.rejected[10] == slow.size - slow.feasible_count


@pytest.mark.parametrize("objective", ranking.OBJECTIVES)
def test_same_ranked_answer(pair, objective):
    fast, slow, _, _ = pair
    fast_order, slow_order = ranking.rank(fast, objective), ranking.rank(slow, objective)
    fast_layouts = [fast.layout(i) for i in fast_order]
    slow_layouts = [slow.layout(i) for i in slow_order]
    assert fast_layouts == slow_layouts
    np.testing.assert_allclose(fast.metrics["tokens_per_s"][fast_order], slow.metrics["tokens_per_s"][slow_order],
                               rtol=1e-9)
    searched = set(recompute_modes(RECOMPUTE_MODES, fast.model, fast.training))
    assert "moe-act" not in searched  # every case is a dense model
    decoded = {lay.recompute for lay in fast_layouts}
    assert decoded <= searched
    # every mode's index decodes in both; partial only where some layout needs part of its layers recomputed
    assert searched - decoded <= {"partial"}
