"""Expert tensor parallelism other than tp (MoE Parallel Folding, Liu et al. 2025, arXiv
2504.14960; Megatron-Core --expert-tensor-parallel-size): the layout field `etp`, its rules, the
expert groups, the memory and time it changes, the engines that run it.
(tests/engines/test_moe_engines.py checks the groups against Megatron's initialize_model_parallel.)"""
from __future__ import annotations

import pytest

from cli_helpers import run_cli
from plan3d.cost.estimate import estimate
from plan3d.cost.memory import model_state_bytes
from plan3d.emit.megatron import emit_megatron
from plan3d.errors import InfeasibleError, LayoutError
from plan3d.run.launch import runtime_problems
from plan3d.layout import Layout, layout_problems
from plan3d.plan import build_plan
from plan3d.rankmap import rankmap_for
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")


def test_etp_equal_to_tp_is_the_default_layout():
    assert Layout(tp=2, dp=4, ep=2, etp=2) == Layout(tp=2, dp=4, ep=2)
    folded = Layout(tp=2, dp=4, ep=8, etp=1)
    assert (folded.expert_tp, folded.expert_dp) == (1, 1)
    assert "ep8 etp1" in folded.short()


def test_ep_folds_over_tp_cp_dp_with_etp():
    with pytest.raises(ValueError, match="ep=8 must divide dp\\*cp=4"):
        Layout(tp=2, dp=4, ep=8)
    with pytest.raises(ValueError, match="ep\\*etp=16 must divide tp\\*cp\\*dp=8"):
        Layout(tp=4, dp=2, ep=8, etp=2)
    with pytest.raises(ValueError, match="ep=8 must divide dp\\*cp=4"):  # etp = tp: the default rule
        Layout(tp=2, dp=4, ep=8, etp=2)


def test_etp_rules_speak(mixtral):
    training = TrainingSpec(global_batch=64)
    assert layout_problems(Layout(tp=2, dp=4, ep=8, etp=1), mixtral, training, 8) == []
    dense = layout_problems(Layout(tp=2, dp=4, ep=8, etp=1), load_model("llama3-8b"), training, 8)
    assert "etp=1 needs a mixture-of-experts model; llama3-8b is dense: drop etp" in dense
    odd = mixtral.model_copy(update={"moe": mixtral.moe.model_copy(update={"expert_ffn_hidden": 14337})})
    problems = layout_problems(Layout(tp=4, dp=2, ep=4, etp=2), odd, training, 8)
    assert any(p.startswith("etp=2 does not divide the expert FFN width 14337") for p in problems), problems


def test_expert_groups_are_megatrons_generator_with_etp():
    """Megatron's expert RankGenerator, order tp-ep-dp-pp with tp = etp: 8 ranks of tp2 dp4."""
    folded = rankmap_for(Layout(tp=2, dp=4, ep=8, etp=1), 8)
    assert folded.groups("ep") == [list(range(8))]
    assert folded.groups("etp") == [[r] for r in range(8)] and folded.groups("edp") == [[r] for r in range(8)]
    half = rankmap_for(Layout(tp=4, dp=2, ep=2, etp=2), 8)
    assert half.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert half.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert half.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "etp" not in rankmap_for(Layout(tp=2, dp=4, ep=2), 8).group_names


def test_experts_split_by_etp_and_sharded_over_the_expert_data_parallel_ranks(mixtral):
    """Mixtral 8x7B, ZeRO-1. tp 2 dp 4: ep 8 etp 1 holds one whole expert per layer, ep 4 at etp = tp
    two halves, the same parameters and, both with edp = 1, the same states. tp 4 dp 2 ep 2: etp 2
    holds each of the 4 local experts in halves instead of quarters, its states over edp =
    tp*dp/(ep*etp) = 2 ranks instead of 1."""
    training = TrainingSpec(global_batch=64)
    h, f, layers = mixtral.hidden, mixtral.moe.expert_ffn_hidden or mixtral.ffn_hidden_, mixtral.layers
    default = model_state_bytes(mixtral, training, Layout(tp=2, dp=4, ep=4, zero=1), 0)
    folded = model_state_bytes(mixtral, training, Layout(tp=2, dp=4, ep=8, etp=1, zero=1), 0)
    assert folded == pytest.approx(default)
    quarter = model_state_bytes(mixtral, training, Layout(tp=4, dp=2, ep=2, etp=2, zero=1), 0)
    plain = model_state_bytes(mixtral, training, Layout(tp=4, dp=2, ep=2, zero=1), 0)
    experts_per_rank = 8 / 2 * 3 * h * f * layers
    assert quarter["weights"] - plain["weights"] == pytest.approx(2 * (experts_per_rank / 2 - experts_per_rank / 4))
    # ZeRO-1: expert states over edp = 8 / (2 * 2) = 2 ranks (etp 2) against 8 / (2 * 4) = 1 (etp = tp 4)
    assert quarter["optimizer"] - plain["optimizer"] == pytest.approx(12 * (experts_per_rank / 2 / 2 - experts_per_rank / 4))


def test_folding_keeps_the_all_to_all_inside_the_node_and_drops_the_token_gather(mixtral):
    """tp 2 x dp 8 on 2 nodes: ep 8 over dp alone (etp = tp) spans both nodes; folded over tp x dp
    (etp 1) the ep group is 8 consecutive ranks, one node, and no expert-TP token gather runs."""
    cluster, training = load_cluster("dgx-h100", 2), TrainingSpec(global_batch=64)
    engine = load_engine("megatron-core")
    base = dict(tp=2, dp=8, zero=1, sequence_parallel=True)
    plain = estimate(cluster, mixtral, training, Layout(ep=8, **base), engine)
    folded = estimate(cluster, mixtral, training, Layout(ep=8, etp=1, **base), engine)
    assert plain.tiers["ep"] == "ib-ndr" and folded.tiers["ep"] == "nvlink4"
    assert folded.time_s["ep_comm"] < plain.time_s["ep_comm"]
    assert folded.time_s["tp_comm"] < plain.time_s["tp_comm"]
    assert folded.tiers["etp"] == "nvlink4"


def test_an_expert_tp_above_tp_gathers_tokens_even_at_tp_1(mixtral):
    cluster, training = load_cluster("dgx-h100", 1), TrainingSpec(global_batch=64)
    engine = load_engine("megatron-core")
    plain = estimate(cluster, mixtral, training, Layout(dp=8, ep=2, zero=1), engine)
    wider = estimate(cluster, mixtral, training, Layout(dp=8, ep=2, etp=4, zero=1), engine)
    assert plain.time_s["tp_comm"] == 0 and wider.time_s["tp_comm"] > 0


def test_shared_experts_keep_the_dense_mlp_exchange(mixtral):
    """Megatron's SharedExpertMLP is a tensor-parallel MLP: an MoE layer with shared experts pays
    the MLP's sequence-parallel exchange as well as the routed tokens' gather."""
    from plan3d.cost.context import make_context
    from plan3d.cost.arrays import layout_arrays
    from plan3d.cost.comm import layout_links
    from plan3d.cost.core import Links, _expert_tp_gather_s, link_row

    import numpy as np

    cluster, training = load_cluster("dgx-h100", 1), TrainingSpec(global_batch=64)
    shared = mixtral.model_copy(update={"moe": mixtral.moe.model_copy(update={"shared_ffn_hidden": 4096})})
    links = Links.from_rows(np.array([link_row(layout_links(4, 1, 2, "tp-cp-ep-dp-pp", tuple(cluster.tiers()), 8, 1, 2))]))
    la = layout_arrays(64, [4], [1], [2], [1], [1], [1], [0], [1.0], [1], [2])
    engine = load_engine("megatron-core")
    without = _expert_tp_gather_s(make_context(cluster, mixtral, training, engine), la, links, np.array([False]))[0]
    with_shared = _expert_tp_gather_s(make_context(cluster, shared, training, engine), la, links, np.array([False]))[0]
    tokens = mixtral.seq_len * mixtral.hidden * 2
    bw, latency = links.of("tp", "all_gather")
    mlp_half = (comm_pair(tokens, 4, bw[0], latency[0], links)) * (1 - engine.runs_as.tp_overlap_fraction)
    assert with_shared - without == pytest.approx(2 * mlp_half, rel=1e-9)


def comm_pair(size, n, bw, latency, links):
    """All-gather + reduce-scatter of `size` over n ranks on the tp link (sequence parallelism)."""
    from plan3d.cost import comm

    rs_bw, rs_latency = (x[0] for x in links.of("tp", "reduce_scatter"))
    return comm.all_gather_s(size, n, bw, latency) + comm.reduce_scatter_s(size, n, rs_bw, rs_latency)


def test_expert_biases_need_an_expert_tp_of_1(mixtral):
    biased = mixtral.model_copy(update={"bias": True})
    engine = load_engine("megatron-core")
    assert engine.layout_problems(Layout(tp=2, dp=4, ep=8, etp=1, sequence_parallel=True), biased) == []
    assert ("megatron-core runs experts with biases only without tensor parallelism (expert tensor parallel 1): "
            "set etp=1 or a model without biases") in engine.layout_problems(Layout(dp=8, ep=2, etp=4), biased)


def test_the_pp_dp_order_needs_expert_dp_equal_to_dp_in_engine_and_emitter(mixtral):
    cluster, training = load_cluster("dgx-h100", 1), TrainingSpec(global_batch=64)
    layout = Layout(tp=2, pp=2, dp=2, ep=2, etp=1, zero=1, sequence_parallel=True, order="tp-cp-ep-pp-dp")
    assert layout.expert_dp == layout.dp == 2
    assert load_engine("megatron-core").layout_problems(layout, mixtral) == []
    assert "--expert-tensor-parallel-size 1" in emit_megatron(build_plan(cluster, mixtral, training, layout)).text


def test_only_megatron_core_runs_etp(mixtral):
    layout = Layout(tp=2, dp=4, ep=8, etp=1, zero=3, sequence_parallel=True)
    assert load_engine("megatron-core").layout_problems(layout, mixtral) == []
    for name in ("torchtitan", "deepspeed-0.19", "plan3d-runtime"):
        problems = load_engine(name).layout_problems(layout, mixtral)
        assert f"{name} splits experts over tp only: drop etp (expert tensor parallel = tp)" in problems


def test_emit_and_launch(mixtral):
    cluster, training = load_cluster("dgx-h100", 1), TrainingSpec(global_batch=64)
    plan = build_plan(cluster, mixtral, training, Layout(tp=2, dp=4, ep=8, etp=1, zero=1, sequence_parallel=True))
    assert "--expert-tensor-parallel-size 1" in emit_megatron(plan).text
    assert "plan3d-runtime splits experts over tp only: drop etp (expert tensor parallel = tp)" in runtime_problems(plan)
    from plan3d.emit.torchtitan import emit_torchtitan

    with pytest.raises(InfeasibleError, match="splits experts over tp only"):
        emit_torchtitan(plan.model_copy(update={"layout": plan.layout.model_copy(update={"zero": 3})}))


def test_estimate_and_rankmap_flags(capsys):
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", "1", "--tp", "2",
                             "--dp", "4", "--ep", "8", "--etp", "1", "--zero", "1", "--sequence-parallel", "--json")
    assert code == 0, err
    import json

    assert json.loads(out)["tiers"]["etp"] == "nvlink4"
    code, out, err = run_cli(capsys, "rankmap", "-c", "dgx-h100", "--nodes", "1", "--tp", "2", "--dp", "4", "--ep", "8",
                             "--etp", "1", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["groups"]["ep"] == [list(range(8))]
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", "1", "--tp", "4",
                             "--dp", "2", "--ep", "8", "--etp", "2")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: ep*etp=16 must divide tp*cp*dp=8"]


def test_a_bad_etp_is_a_layout_error():
    from plan3d.cli.common import make_layout

    with pytest.raises(LayoutError, match="etp"):
        make_layout(tp=2, dp=4, ep=8, etp=0)
