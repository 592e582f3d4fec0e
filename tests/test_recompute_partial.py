"""Partial recompute (Megatron-Core `--recompute-granularity full --recompute-method block
--recompute-num-layers N`): the first N layers of each virtual chunk fully recomputed, N the
fewest that make the most-loaded rank fit (docs/cost-model.md, Memory)."""
from __future__ import annotations

import pytest

from cli_helpers import run_cli
from plan3d.cost.estimate import estimate
from plan3d.emit.megatron import megatron_args
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.search import Space, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model, with_gpu_memory
from plan3d.specs.training import TrainingSpec

GIB = 2**30
TRAINING = TrainingSpec(global_batch=1536, seq_len=2048)


@pytest.fixture(scope="module")
def gpt3():
    return load_model("gpt3-175b")


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-a100-80g", 64)  # 512 A100 80GB


def _layout(recompute: str, vpp: int = 1) -> Layout:
    return Layout(tp=8, pp=8, dp=8, micro_batch=2, vpp=vpp, zero=1, recompute=recompute, sequence_parallel=False)


def _estimate(cluster, model, recompute, vpp=1):
    return estimate(cluster, model, TRAINING, _layout(recompute, vpp), engine=load_engine("megatron-core")).to_dict()


def test_partial_fits_where_none_does_not_and_is_faster_than_full(cluster, gpt3):
    none, partial, full = (_estimate(cluster, gpt3, rc) for rc in ("none", "partial", "full"))
    assert not none["fits"] and partial["fits"] and full["fits"]
    assert 1 <= partial["recompute_layers"] < gpt3.layers // 8
    assert full["peak_memory_bytes"] < partial["peak_memory_bytes"] <= partial["capacity_bytes"]
    assert partial["peak_memory_bytes"] < none["peak_memory_bytes"]
    assert none["step_time_s"] < partial["step_time_s"] < full["step_time_s"]


def test_the_recompute_pass_is_the_share_of_layers_recomputed(cluster, gpt3):
    """By hand: pp 8 of 96 layers is 12 per rank; with vpp 2 each rank has two chunks of 6 and
    recomputes the first N of each, 2N of its 12 layers, so its recompute pass is 2N/12 of full's."""
    for vpp in (1, 2):
        partial, full = _estimate(cluster, gpt3, "partial", vpp), _estimate(cluster, gpt3, "full", vpp)
        n = partial["recompute_layers"]
        assert n >= 1
        assert partial["time_s"]["recompute"] == pytest.approx(n * vpp / 12 * full["time_s"]["recompute"], rel=1e-6)
        assert partial["hfu"] * partial["step_time_s"] > _estimate(cluster, gpt3, "none", vpp)["hfu"] \
            * _estimate(cluster, gpt3, "none", vpp)["step_time_s"]  # the recomputed layers' FLOPs are counted


def test_n_is_the_fewest_layers_that_fit(gpt3):
    """Sweep the GPU memory: at each capacity the chosen N fits, and the peak seen at N - 1 (at a
    larger capacity) does not fit this one; N grows as memory shrinks; with enough memory N is 0
    and the layout runs exactly as recompute none."""
    peaks, chosen = {}, []
    for gib in range(36, 96):
        cluster = with_gpu_memory(load_cluster("dgx-a100-80g", 64), gib)
        est = _estimate(cluster, gpt3, "partial")
        n = est["recompute_layers"]
        if not est["fits"]:
            assert n == 12 - 1  # the most a chunk may recompute and still be partial
            continue
        peaks.setdefault(n, est["peak_memory_bytes"])
        chosen.append((est["capacity_bytes"], n))
        if n == 0:
            none = _estimate(cluster, gpt3, "none")
            assert (est["step_time_s"], est["peak_memory_bytes"]) == (none["step_time_s"], none["peak_memory_bytes"])
    assert len({n for _, n in chosen}) >= 4  # the sweep crosses several N, including 0
    assert 0 in {n for _, n in chosen}
    for capacity, n in chosen:
        if n - 1 in peaks:
            assert peaks[n - 1] > capacity
    ns = [n for _, n in sorted(chosen)]
    assert ns == sorted(ns, reverse=True)  # more memory, fewer layers recomputed


def test_the_search_offers_partial_only_where_it_recomputes_something_and_the_engine_runs_it(cluster, gpt3):
    space = Space(max_micro_batch=2, max_vpp=2)
    mc = search(cluster, gpt3, TRAINING, space, engine=load_engine("megatron-core"))
    partial = [i for i in range(mc.size) if mc.layout(i).recompute == "partial"]
    assert partial and all(mc.metrics["recompute_layers"][i] >= 1 for i in partial)
    assert mc.rejected[22] > 0  # partial layouts that fit without recompute: dropped, same as none
    for name in ("megatron-deepspeed", "deepspeed-0.19"):
        other = search(cluster, gpt3, TRAINING, space, engine=load_engine(name))
        assert "partial" not in {other.layout(i).recompute for i in range(other.size)}


def test_emit_megatron_writes_block_recompute_of_the_estimated_layers(cluster, gpt3):
    est = _estimate(cluster, gpt3, "partial")
    plan = build_plan(cluster, gpt3, TRAINING, _layout("partial"), est, load_engine("megatron-core"))
    args = megatron_args(plan)
    at = args.index("--recompute-granularity")
    assert args[at:at + 6] == ["--recompute-granularity", "full", "--recompute-method", "block",
                               "--recompute-num-layers", str(est["recompute_layers"])]


def test_emit_refuses_partial_without_an_estimate_or_with_nothing_to_recompute(gpt3):
    cluster = load_cluster("dgx-a100-80g", 64)
    bare = build_plan(cluster, gpt3, TRAINING, _layout("partial"), engine=load_engine("megatron-core"))
    with pytest.raises(InfeasibleError, match="recommend --out"):
        megatron_args(bare)
    roomy = with_gpu_memory(cluster, 141)
    plan = build_plan(roomy, gpt3, TRAINING, _layout("partial"), _estimate(roomy, gpt3, "partial"),
                      load_engine("megatron-core"))
    with pytest.raises(InfeasibleError, match="use recompute none"):
        megatron_args(plan)


def test_estimate_names_the_layers_recomputed(capsys):
    code, out, _ = run_cli(capsys, "estimate", "-c", "dgx-a100-80g", "--nodes", "64", "-m", "gpt3-175b", "--tp", "8",
                           "--pp", "8", "--micro-batch", "2", "--zero", "1", "--recompute", "partial",
                           "--global-batch", "1536", "--engine", "megatron-core")
    assert code == 0
    assert "recompute partial (the first" in " ".join(out.split())
    code, _, err = run_cli(capsys, "estimate", "-c", "dgx-a100-80g", "--nodes", "64", "-m", "gpt3-175b", "--tp", "8",
                           "--pp", "8", "--zero", "0", "--recompute", "partial", "--global-batch", "1536",
                           "--engine", "torchtitan")
    assert code != 0 and "torchtitan has no partial recompute" in err
