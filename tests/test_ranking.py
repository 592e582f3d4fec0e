"""Ranking: order keys, Pareto front, nearest misses; and the sanity cases of issue 5."""
import numpy as np
import pytest

from plan3d import ranking
from plan3d.search import Space, nodes_to_fit, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

GPT3_TRAINING = TrainingSpec(global_batch=1536)
ONE_B = ModelSpec(name="gpt-1b", layers=24, hidden=2048, heads=16, vocab=50257, seq_len=2048)


@pytest.fixture(scope="module")
def gpt3_512():
    result = search(load_cluster("dgx-a100-80g", 64), load_model("gpt3-175b"), GPT3_TRAINING)
    return result, ranking.rank(result)


@pytest.fixture(scope="module")
def small():
    result = search(load_cluster("dgx-a100-80g", 2), load_model("llama3-8b"), TrainingSpec(global_batch=64),
                    Space(max_micro_batch=4, max_vpp=4))
    return result, ranking.rank(result)


# ---- the order keys --------------------------------------------------------------------------
def test_feasible_first_then_objective_descending(small):
    result, order = small
    feasible = result.feasible[order]
    n = result.feasible_count
    assert feasible[:n].all() and not feasible[n:].any()
    tokens = result.metrics["tokens_per_s"][order[:n]]
    assert (np.diff(tokens) <= tokens[0] * ranking.TIE_PPM).all()


def test_ties_go_to_less_memory_then_fewer_moving_parts(small):
    result, order = small
    m = result.metrics
    cost = ranking.ranking_cost(result, "throughput", "expected")
    parts = ranking.moving_parts(result.layouts)
    ties = 0
    for a, b in zip(order[: result.feasible_count - 1], order[1: result.feasible_count]):
        assert m["band_tier"][a] <= m["band_tier"][b] or cost[a] < cost[b]  # a tie goes to fewer extrapolations
        if cost[a] == cost[b] and m["band_tier"][a] == m["band_tier"][b]:
            ties += 1
            assert m["peak_memory_bytes"][a] <= m["peak_memory_bytes"][b]
            if m["peak_memory_bytes"][a] == m["peak_memory_bytes"][b]:
                assert parts[a] <= parts[b]
    assert ties > 0, "the case should contain ties (e.g. sequence parallel on and off)"


def test_memory_objective_puts_least_memory_first(small):
    result, _ = small
    order = ranking.rank(result, "memory")
    feasible_memory = result.metrics["peak_memory_bytes"][result.feasible]
    assert result.metrics["peak_memory_bytes"][order[0]] == feasible_memory.min()


def test_infeasible_rows_come_nearest_miss_first(gpt3_512):
    result, order = gpt3_512
    misses = ranking.nearest_misses(result, order, k=20)
    fraction = ranking.memory_fraction(result)[misses]
    assert (fraction > 1).all() and (np.diff(fraction) >= 0).all()


def test_pareto_front_is_exactly_the_non_dominated_set(small):
    result, order = small
    front = set(ranking.pareto_front(result, order).tolist())
    rows = np.flatnonzero(result.feasible)
    tokens = result.metrics["tokens_per_s"]
    headroom = result.metrics["capacity_bytes"] - result.metrics["peak_memory_bytes"]
    points = {}
    for r in rows:  # brute force: best row per distinct (tokens, headroom) point, undominated points only
        dominated = ((tokens[rows] >= tokens[r]) & (headroom[rows] >= headroom[r])
                     & ((tokens[rows] > tokens[r]) | (headroom[rows] > headroom[r]))).any()
        if not dominated:
            points.setdefault((tokens[r], headroom[r]), r)
    assert len(front) == len(points)
    assert {(tokens[r], headroom[r]) for r in front} == set(points)


def test_why_names_the_runner_up(gpt3_512):
    result, order = gpt3_512
    sentence = ranking.why_wins(result, order)
    assert result.layout(order[0]).short() in sentence and result.layout(order[1]).short() in sentence


def test_suggestions_lower_memory_of_a_miss(gpt3_512):
    result, order = gpt3_512
    miss = int(ranking.nearest_misses(result, order, k=1)[0])
    items = ranking.suggestions(result, miss)
    assert items
    assert all(s.peak_memory_bytes < result.metrics["peak_memory_bytes"][miss] for s in items
               if s.change in ("ZeRO-3", "full recompute", "micro-batch 1"))


def test_nodes_to_fit_finds_a_cluster_that_fits():
    cluster, model = load_cluster("dgx-h100", 2), load_model("llama3-405b")
    training = TrainingSpec(global_batch=64)
    assert search(cluster, model, training).feasible_count == 0
    nodes = nodes_to_fit(cluster, model, training)
    assert nodes is not None and nodes > 2
    assert search(cluster.with_size(nodes=nodes), model, training).feasible_count > 0


# ---- sanity (issue 5) ----------------------------------------------------------------------------
def test_gpt3_top_layouts_fit_and_keep_tp_inside_a_node(gpt3_512):
    result, order = gpt3_512
    assert len(order) >= 5
    for row in order[:5]:
        assert result.feasible[row]
        assert result.layout(row).tp <= 8


def test_gpt3_top_layouts_use_pipeline_parallelism(gpt3_512):
    result, order = gpt3_512
    assert len(order) >= 5 and all(result.layout(row).pp > 1 for row in order[:5])


def seed_rows(result):
    lay = result.layouts
    return np.flatnonzero((lay["tp"] == 8) & (lay["pp"] == 8) & (lay["dp"] == 8) & result.feasible)


def test_gpt3_seed_layout_is_feasible(gpt3_512):
    result, _ = gpt3_512
    assert len(seed_rows(result)) > 0


@pytest.fixture(scope="module")
def gpt3_512_megatron_2021():
    result = search(load_cluster("dgx-a100-80g", 64), load_model("gpt3-175b"), GPT3_TRAINING,
                    engine=load_engine("megatron-lm-2021"))
    return result, ranking.rank(result)


def test_gpt3_seed_layout_is_within_a_few_percent_of_the_best(gpt3_512_megatron_2021):
    """Narayanan et al. 2021 ran GPT-3 175B as TP8 PP8 on DGX A100 with Megatron-LM of that year;
    predicted for that engine, its best TP8 PP8 variant is within 5% of the best layout (issue 14:
    with the vTrain-fitted 24.7 us NVLink hop it was 14% behind, about rank 1,000)."""
    result, order = gpt3_512_megatron_2021
    seed_best = result.metrics["tokens_per_s"][seed_rows(result)].max()
    assert seed_best >= 0.95 * result.metrics["tokens_per_s"][order[0]]


def test_one_billion_on_eight_gpus_is_data_parallel():
    result = search(load_cluster("dgx-a100-80g", 1), ONE_B, TrainingSpec(global_batch=256))
    order = ranking.rank(result)
    best = result.layout(order[0])
    assert best.tp == 1 and best.pp == 1 and best.dp == 8, best.short()


def faster_fabric(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    data = cluster.model_dump()
    bandwidth = data["network"][-1]["bandwidth"]
    key = next(k for k in ("gbytes_per_s_per_gpu", "gbytes_per_s_per_node", "gbit_per_s_per_nic") if bandwidth.get(k))
    bandwidth[key] *= factor
    return ClusterSpec.model_validate(data)


@pytest.mark.parametrize("cluster_name, nodes, model_name, batch", [
    ("dgx-a100-80g", 64, "gpt3-175b", 1536),
    ("dgx-h100", 4, "llama3-8b", 128),
    ("dgx-a100-40g", 16, "gpt-neox-20b", 512),
])
def test_faster_inter_node_fabric_never_slows_the_best(cluster_name, nodes, model_name, batch):
    cluster, model, training = load_cluster(cluster_name, nodes), load_model(model_name), TrainingSpec(global_batch=batch)
    steps = []
    for factor in (0.5, 1.0, 2.0, 4.0):
        result = search(faster_fabric(cluster, factor), model, training)
        steps.append(result.metrics["step_time_s"][ranking.rank(result)[0]])
    assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:])), steps


# ---- fit thresholds: the search's codes and check's findings are one table (plan3d.fit_rules) ------
@pytest.mark.parametrize("min_mfu, max_fraction", [(None, None), (0.4, None), (None, 0.7), (0.45, 0.6)])
def test_check_findings_and_search_codes_agree_on_every_prediction(min_mfu, max_fraction):
    """search.fit_reasons (arrays, first rule) and ranking.fit_findings (one estimate, every rule):
    no finding exactly where the code is 0, else the first finding is the coded rule's sentence."""
    from plan3d.fit_rules import FIT_RULES, FitFacts
    from plan3d.search import fit_reasons

    rng, gpu, n = np.random.default_rng(7), 80 * 2**30, 300
    peak = rng.uniform(0.3, 1.1, n) * gpu
    capacity = np.full(n, 0.9 * gpu)
    metrics = {"peak_memory_bytes": peak, "capacity_bytes": capacity, "fits": peak <= capacity,
               "mfu": rng.uniform(0.2, 0.6, n)}
    codes = fit_reasons(metrics, n, min_mfu, max_fraction, gpu)
    limits = {None: None, "min_mfu": min_mfu, "max_memory_fraction": max_fraction}
    by_code = {rule.code: rule for rule in FIT_RULES}
    for i in range(n):
        est = {k: (bool(v[i]) if k == "fits" else float(v[i])) for k, v in metrics.items()}
        findings = ranking.fit_findings(est, gpu, min_mfu, max_fraction)
        assert (codes[i] == 0) == (not findings), (est, codes[i])
        if findings:
            rule = by_code[int(codes[i])]
            assert findings[0].message == rule.sentence(FitFacts.of(est, gpu), limits[rule.threshold])
            assert all(f.level == "error" and f.fix for f in findings)
    expected = {10} | ({11} if min_mfu else set()) | ({12} if max_fraction else set())
    assert set(codes.tolist()) - {0} == expected, "every rule in force should reject some prediction"


def test_fit_findings_say_what_is_over_and_by_how_much():
    est = {"fits": False, "mfu": 0.3, "peak_memory_bytes": 90 * 2**30, "capacity_bytes": 72 * 2**30}
    findings = ranking.fit_findings(est, 80 * 2**30, min_mfu=0.4, max_memory_fraction=0.9)
    assert [f.message for f in findings] == [
        "predicted peak memory 90.0 GiB per GPU exceeds the 72.0 GiB usable (GPU memory less headroom and reserve)",
        "predicted MFU 30.0% is below --min-mfu 40.0%",
        "predicted peak memory is 112.5% of the GPU's memory, above --max-memory-fraction 90.0%"]
