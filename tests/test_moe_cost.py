"""Mixture of experts in the planner: the layout rules, the memory contract, the time model, the search
and the command line (docs/cost-model.md, "Mixture of experts").

The shared accounting contract: a rank holds the dense part (attention, norms, dense MLPs, the
router, shared experts and shared gate; replicated over ep, ZeRO over dp*cp) and experts/ep local
experts split by tp (ZeRO over edp = dp*cp/ep)."""
from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.cost.comm import layout_links
from plan3d.cost.compute import model_flops_per_step
from plan3d.cost.context import MOE_IMBALANCE, make_context
from plan3d.cost.estimate import estimate
from plan3d.cost.memory import model_state_bytes
from plan3d.cost.params import active_layer_params, expert_params, norm_params, total_params
from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems, problem_codes
from plan3d.ranking import rank
from plan3d.search import Space, balanced_split, engine_space, evaluate, evaluate_scalar, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

MEGATRON = "megatron-core"


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")


@pytest.fixture(scope="module")
def deepseek():
    return load_model("deepseek-v3")


@pytest.fixture(scope="module")
def h100_512():
    return load_cluster("dgx-h100")  # 64 nodes x 8


# ---- the hand calculation of docs/cost-model.md ------------------------------------------------
def hand_memory(model: ModelSpec, tp: int, pp: int, dp: int, ep: int, pp_rank: int, micro_batches: int) -> dict:
    """Memory of one rank of Mixtral 8x7B (every layer MoE, SwiGLU, no biases, untied) under
    tp/pp/dp/ep, micro-batch 1, ZeRO-1, full recompute, sequence parallelism, bf16 with fp32
    gradients and Adam: written out from the model's numbers alone."""
    h, layers, vocab, seq = model.hidden, model.layers // pp, model.vocab, model.seq_len
    experts, top_k, fe = model.moe.experts, model.moe.top_k, model.moe.expert_ffn_hidden or model.ffn_hidden_
    q, kv = model.heads * (h // model.heads), model.kv_heads_ * (h // model.heads)
    attention = h * (q + 2 * kv) + q * h
    dense_layer = attention / tp + 2 * h + h * experts  # norms and router replicated over tp
    expert_layer = experts / ep * 3 * h * fe / tp  # experts / ep local experts, each split by tp
    vocab_rows = -(-vocab // tp) * h
    ends = vocab_rows * (pp_rank == 0) + (h + vocab_rows) * (pp_rank == pp - 1)
    dense, routed_params = layers * dense_layer + ends, layers * expert_layer
    edp = dp // ep
    tokens, routed = seq, top_k * seq * MOE_IMBALANCE  # per rank; routed copies at the 1.1x prior
    moe_layer = ((8 * tokens * h / tp + 2 * tokens * (2 * q + 2 * kv) / tp + 2 * routed * fe * 3 / tp)
                 + (routed * h + 2 * tokens * experts / tp) * 2)  # bf16 bytes: stored + permuted input, router
    # (Megatron-Core scales the experts' activation by the router probabilities: the combine keeps nothing)
    checkpoint = 2 * tokens * h / tp  # each layer's input, sequence-split, bf16
    in_flight = min(pp - pp_rank, micro_batches)
    logits = tokens * vocab_rows / h / tp * 4 * (pp_rank == pp - 1)
    boundary = tokens * h * 2
    buffers = 2 * boundary / tp * (pp > 1) + boundary + 2 * routed * h / tp * 2  # p2p, SP gather, a2a
    return {"weights": (dense + routed_params) * 2, "gradients": (dense + routed_params) * 4,
            "optimizer": 12 * (dense / dp + routed_params / edp),
            "activations": in_flight * layers * checkpoint + moe_layer + logits, "buffers": buffers}


def test_the_documented_mixtral_example_adds_up_by_hand(h100_512, mixtral):
    """`plan3d estimate -c dgx-h100 -m mixtral-8x7b --tp 2 --pp 4 --dp 64 --ep 8 --zero 1
    --recompute full --sequence-parallel`: every memory row recomputed from the model."""
    training = TrainingSpec(global_batch=1024)
    layout = Layout(tp=2, pp=4, dp=64, ep=8, zero=1, recompute="full", sequence_parallel=True)
    est = estimate(h100_512, mixtral, training, layout, load_engine(MEGATRON))
    rank = est.worst_pp_rank
    hand = hand_memory(mixtral, 2, 4, 64, 8, rank, micro_batches=1024 // 64)
    for key, value in hand.items():
        assert est.memory_bytes[key] == pytest.approx(value, rel=1e-12), key
    assert est.peak_memory_bytes == pytest.approx(sum(hand.values()) + est.memory_bytes["reserve"], rel=1e-12)
    for r in range(4):
        states = model_state_bytes(mixtral, training, layout, r)
        mine = hand_memory(mixtral, 2, 4, 64, 8, r, 16)
        assert states == pytest.approx({k: mine[k] for k in states}, rel=1e-12)
    assert est.fits and rank == 0 and est.peak_memory_bytes / 2**30 == pytest.approx(9.43, abs=0.005)  # the docs' figure
    assert est.tiers["ep"] == "ib-ndr" and est.tiers["edp"] == "ib-ndr"  # tp 2 x ep 8 = 16 ranks: two nodes
    assert not any("dense" in w for w in est.warnings)


# ---- the memory contract --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "tiny-moe"])
def test_one_unsharded_rank_holds_the_whole_model(name):
    """tp = pp = ep = 1, ZeRO-0: the weights of one rank are every parameter of params.total_params."""
    model = load_model(name)
    states = model_state_bytes(model, TrainingSpec(global_batch=8), Layout(dp=8), 0)
    assert states["weights"] == 2 * total_params(model)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3"])
def test_ep_removes_the_other_ranks_experts(name):
    """ep = E: each rank keeps one expert per MoE layer; the rest of the model is unchanged."""
    model = load_model(name)
    experts = model.moe.experts
    states = model_state_bytes(model, TrainingSpec(global_batch=experts), Layout(dp=experts, ep=experts), 0)
    dropped = model.moe_layers * (experts - 1) * expert_params(model)
    assert states["weights"] == 2 * (total_params(model) - dropped)


def test_zero_shards_experts_over_edp_and_the_rest_over_dp(mixtral):
    """ZeRO-1 divides the optimizer states of the experts by dp/ep and the dense part by dp."""
    training = TrainingSpec(global_batch=64)
    base = dict(tp=1, pp=1, dp=16, ep=4)
    zero0 = model_state_bytes(mixtral, training, Layout(**base, zero=0), 0)["optimizer"]
    zero1 = model_state_bytes(mixtral, training, Layout(**base, zero=1), 0)["optimizer"]
    experts_on_rank = mixtral.moe_layers * (8 // 4) * expert_params(mixtral)
    dense_on_rank = zero0 / 12 - experts_on_rank
    assert zero1 == pytest.approx(12 * (dense_on_rank / 16 + experts_on_rank / 4), rel=1e-12)


def test_stages_hold_their_own_moe_layers(deepseek):
    """DeepSeek-V3's first three layers are dense: the first stage holds fewer experts."""
    training = TrainingSpec(global_batch=256)
    layout = Layout(pp=16, dp=64, ep=8, pp_layers=balanced_split(61, 16))
    first, second = (model_state_bytes(deepseek, training, layout, r)["weights"] for r in (0, 1))
    assert first < second  # 3 layers, all dense (+ embedding) against 4 MoE layers


# ---- the time model ---------------------------------------------------------------------------------
def test_model_flops_count_the_active_parameters(mixtral):
    """MFU's FLOPs: 6 x tokens x active layer GEMM parameters + attention scores (half of them,
    causal) + logits."""
    training = TrainingSpec(global_batch=64)
    ctx = make_context(None, mixtral, training)
    tokens = 64 * mixtral.seq_len
    gemm = sum(active_layer_params(mixtral, i) - 2 * norm_params(mixtral) for i in range(mixtral.layers))
    scores = mixtral.layers * 4 * 64 * mixtral.seq_len**2 * mixtral.hidden
    noncausal = 3 * (2 * tokens * gemm + scores + 2 * tokens * mixtral.hidden * mixtral.vocab)
    assert model_flops_per_step(ctx, causal=False) == pytest.approx(noncausal, rel=1e-12)
    assert model_flops_per_step(ctx) == pytest.approx(noncausal - 3 * scores / 2, rel=1e-12)


def test_ep_all_to_alls_by_hand(h100_512, mixtral):
    """ep_comm = micro-batches x layers x 4 all-to-alls (dispatch, combine; forward and backward),
    each (ep-1)/ep of top_k x tokens x 1.1 x h bf16 bytes (sequence-split by tp) on the ep group's link."""
    training = TrainingSpec(global_batch=1024)
    engine = load_engine(MEGATRON)
    layout = Layout(tp=2, pp=1, dp=256, ep=8, zero=1, sequence_parallel=True)
    est = estimate(h100_512, mixtral, training, layout, engine)
    link = layout_links(2, 1, 256, layout.order, tuple(h100_512.tiers()), 8, 1, 8)["ep"]
    bandwidth, latency = link.cost("all_gather")
    size = 2 * mixtral.seq_len * MOE_IMBALANCE * mixtral.hidden * 2 / 2
    one = 7 / 8 * size / bandwidth + 7 * latency
    assert est.time_s["ep_comm"] == pytest.approx(1024 // 256 * 32 * 4 * one, rel=1e-9)
    assert link.tier == "ib-ndr"
    inside = estimate(h100_512, mixtral, training, Layout(dp=512, ep=8, zero=1), engine)
    assert inside.tiers["ep"] == "nvlink4" and inside.time_s["ep_comm"] > 0
    plain = estimate(h100_512, mixtral, training, layout.model_copy(update={"ep": 1}), engine)
    assert plain.time_s["ep_comm"] == 0 and "ep" not in plain.tiers


def test_smaller_experts_run_further_below_the_gemm_ceiling():
    """Fine-grained MoE: the same active FLOPs split into 4x more, 4x narrower experts take longer."""
    cluster = load_cluster("dgx-h100", 1)
    coarse = ModelSpec(name="coarse", layers=4, hidden=2048, heads=16, activation="swiglu", bias=False,
                       norm="rmsnorm", position="rope", vocab=32000, seq_len=4096,
                       moe={"experts": 8, "top_k": 2, "expert_ffn_hidden": 4096})
    fine = coarse.model_copy(update={"moe": coarse.moe.model_copy(update={"experts": 32, "top_k": 8,
                                                                           "expert_ffn_hidden": 1024})})
    training = TrainingSpec(global_batch=8)
    layout = Layout(dp=8, ep=8)
    a, b = (estimate(cluster, m, training, layout, load_engine(MEGATRON)) for m in (coarse, fine))
    assert b.time_s["compute"] > a.time_s["compute"]
    assert a.model_tflops_per_gpu > b.model_tflops_per_gpu * 0.99  # near-equal FLOPs, the router aside


def test_a_dense_model_is_untouched_by_the_moe_terms(h100_512):
    est = estimate(h100_512, load_model("llama3-70b"), TrainingSpec(global_batch=512),
                   Layout(tp=8, pp=4, dp=16, zero=1, sequence_parallel=True), load_engine(MEGATRON))
    assert est.time_s["ep_comm"] == 0 and "ep" not in est.tiers


# ---- batch = scalar ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, nodes, uneven", [("mixtral-8x7b", 4, False), ("tiny-moe", 1, False),
                                                 ("deepseek-v3", 8, True)])
def test_vectorised_moe_estimates_equal_the_scalar_ones(name, nodes, uneven):
    """Every-layer MoE (three stage kinds), every-other-layer MoE and first-dense-layers with uneven
    splits (every rank listed): estimate_batch agrees with estimate() on sampled search rows."""
    cluster, model = load_cluster("dgx-h100", nodes), load_model(name)
    training = TrainingSpec(global_batch=model.default_global_batch if name != "deepseek-v3" else 1024)
    engine = load_engine(MEGATRON)
    space = Space(uneven=uneven, max_micro_batch=2, max_vpp=2, min_pp=1 if not uneven else 4)
    result = search(cluster, model, training, space, engine=engine)
    rows = np.random.default_rng(1).choice(result.size, size=min(24, result.size), replace=False)
    sample = {k: a[rows] for k, a in result.layouts.items()}
    assert (sample["ep"] > 1).any()
    vec = evaluate(cluster, model, training, sample, result.orders, engine)
    one = evaluate_scalar(cluster, model, training, sample, result.orders, engine)
    for key, values in one.items():
        np.testing.assert_allclose(np.asarray(vec[key], float), np.asarray(values, float), rtol=1e-9, err_msg=key)


def test_candidates_with_ep_equal_the_scalar_estimate(h100_512, mixtral):
    training = TrainingSpec(global_batch=1024)
    engine = load_engine(MEGATRON)
    layouts = [Layout(tp=1, pp=1, dp=512, ep=8, zero=3), Layout(tp=2, pp=4, dp=64, ep=4, zero=1, vpp=2,
                                                                 recompute="full", sequence_parallel=True)]
    col = lambda f: np.array([f(x) for x in layouts])  # noqa: E731
    cands = Candidates(col(lambda x: x.tp), col(lambda x: x.pp), col(lambda x: x.dp), col(lambda x: x.micro_batch),
                       col(lambda x: x.vpp), col(lambda x: x.zero), col(lambda x: RECOMPUTE_CODES[x.recompute]),
                       col(lambda x: x.sequence_parallel), np.zeros(2, dtype=int), ep=col(lambda x: x.ep))
    batch = estimate_batch(h100_512, mixtral, training, cands, ("tp-cp-ep-dp-pp",), engine)
    for i, layout in enumerate(layouts):
        one = estimate(h100_512, mixtral, training, layout, engine)
        assert batch["step_time_s"][i] == pytest.approx(one.step_time_s, rel=1e-9)
        assert batch["peak_memory_bytes"][i] == pytest.approx(one.peak_memory_bytes, rel=1e-9)
        assert batch["ep_comm_s"][i] == pytest.approx(one.time_s["ep_comm"], rel=1e-9)


# ---- layout rules and engines -------------------------------------------------------------------
def test_ep_rules_speak_and_match_the_search_codes(mixtral):
    training = TrainingSpec(global_batch=64)
    dense = load_model("llama3-8b")
    assert layout_problems(Layout(dp=8, ep=2), dense, training, 8) == [
        "ep=2 needs a mixture-of-experts model; llama3-8b is dense: use ep=1"]
    assert problem_codes(Layout(dp=8, ep=2), dense, training, 8) == [17]
    (sentence,) = layout_problems(Layout(dp=16, ep=16), mixtral, training, 16)
    assert "ep=16 does not divide the 8 routed experts" in sentence and "valid ep: 1, 2, 4, 8" in sentence
    assert problem_codes(Layout(dp=16, ep=16), mixtral, training, 16) == [18]
    with pytest.raises(ValueError, match="ep=3 must divide dp\\*cp=8"):
        Layout(dp=8, ep=3)


def test_engines_without_expert_parallelism_refuse_it(h100_512, mixtral):
    deepspeed = load_engine("deepspeed")  # the 2021 profile; deepspeed-0.19 runs AutoEP
    assert not deepspeed.can_run.expert_parallel
    assert all(load_engine(n).can_run.expert_parallel
               for n in ("megatron-core", "torchtitan", "plan3d-runtime", "deepspeed-0.19"))
    assert not any(load_engine(n).can_run.expert_parallel for n in ("megatron-lm-2021", "megatron-deepspeed"))
    with pytest.raises(LayoutError, match="deepspeed has no expert parallelism"):
        estimate(h100_512, mixtral, TrainingSpec(global_batch=1024), Layout(dp=512, ep=8), deepspeed)
    assert engine_space(Space(), deepspeed).max_ep == 1
    with pytest.raises(LayoutError, match="no expert parallelism"):
        engine_space(Space(min_ep=2), deepspeed)


def test_megatron_core_needs_sequence_parallelism_for_moe_with_tp(h100_512, mixtral):
    """Megatron-Core raises for an MoE model with tp > 1 and no sequence parallelism, at any ep
    (TransformerConfig for ep > 1, MoELayer.forward for ep = 1): estimate refuses it by name, the
    search drops it under its own reason (code 19); dense models are not affected."""
    training = TrainingSpec(global_batch=1024)
    megatron = load_engine(MEGATRON)
    for ep in (1, 8):
        with pytest.raises(LayoutError, match="megatron-core runs a mixture-of-experts model with tp > 1 only with "
                                              "sequence parallelism"):
            estimate(h100_512, mixtral, training, Layout(tp=2, dp=256, ep=ep), megatron)
    result = search(load_cluster("dgx-h100", 2), mixtral, training, engine=megatron)
    lay = result.layouts
    assert result.rejected[19] > 0
    assert not ((lay["tp"] > 1) & ~lay["sequence_parallel"].astype(bool)).any()
    dense = search(load_cluster("dgx-h100", 2), load_model("llama3-8b"), TrainingSpec(global_batch=64), engine=megatron)
    assert not dense.rejected.get(19) and ((dense.layouts["tp"] > 1) & ~dense.layouts["sequence_parallel"]).any()
    assert estimate(h100_512, mixtral, training, Layout(tp=2, dp=256), load_engine("torchtitan")).step_time_s > 0


# ---- the search: the done-when checks ------------------------------------------------------------
def test_recommend_mixtral_picks_expert_parallel_layouts(h100_512, mixtral):
    """`plan3d recommend -c dgx-h100 -m mixtral-8x7b`: ep > 1 among the top picks, every ep a
    divisor of gcd(8, dp*cp) at etp = tp (of tp*cp*dp / etp with ETP1, MoE Parallel Folding), and
    the best ep = 1 layout slower than the best EP one."""
    result = search(h100_512, mixtral, TrainingSpec(global_batch=1024), engine=load_engine(MEGATRON))
    order = rank(result)
    top = [result.layout(int(i)) for i in order[:5]]
    assert any(lay.ep > 1 for lay in top)
    eps = result.layouts["ep"]
    assert set(eps.tolist()) == {1, 2, 4, 8}
    default = result.layouts["etp"] == result.layouts["tp"]
    assert ((result.layouts["dp"][default] % eps[default]) == 0).all()
    stage = result.layouts["tp"] * result.layouts["dp"]
    assert ((stage % (eps * result.layouts["etp"])) == 0).all() and (~default).any()
    tokens = np.where(result.feasible, result.metrics["tokens_per_s"], 0)
    assert tokens[eps > 1].max() > tokens[eps == 1].max()


def test_a_deepseek_v3_sized_model_fits_on_2048_h100_only_with_ep(deepseek):
    """DeepSeek-V3 (671B) on 256 DGX H100 nodes, pp 16 with an uneven split: no ep = 1 layout fits
    (the experts alone are 1.3 TB of bf16 weights per pipeline replica), EP layouts do."""
    cluster = load_cluster("dgx-h100", 256)
    space = Space(min_tp=1, max_tp=2, min_pp=16, max_pp=16, uneven=True, zero=(1,), recompute=("full",),
                  max_micro_batch=1, max_vpp=1)
    result = search(cluster, deepseek, TrainingSpec(global_batch=15360), space, engine=load_engine(MEGATRON))
    eps = result.layouts["ep"]
    assert not (result.feasible & (eps == 1)).any()
    assert (result.feasible & (eps > 1)).any()
    best = result.layout(int(rank(result)[0]))
    assert best.ep > 1 and 256 % best.ep == 0


# ---- the command line --------------------------------------------------------------------------
def test_estimate_ep_flag(capsys):
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--tp", 2, "--pp", 4,
                             "--ep", 8, "--zero", 1, "--recompute", "full", "--sequence-parallel")
    assert code == 0, err
    assert "ep 8" in out and "EP all-to-all" in out and "ep ib-ndr" in out and "modelled as dense" not in out + err
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--ep", 16)
    assert code != 0 and "does not divide the 8 routed experts" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--ep", 2)
    assert code != 0 and "needs a mixture-of-experts model" in err and "Traceback" not in err


def test_recommend_ep_flags(capsys):
    args = ("recommend", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", 2, "--top", 3)
    code, out, err = run_cli(capsys, *args, "--ep", 4)
    assert code == 0, err
    assert "┃ ep ┃" in out and "ep4" in out and "ep8" not in out and "ep2" not in out
    code, out, err = run_cli(capsys, *args, "--max-ep", 0)
    assert code != 0 and "--max-ep must be >= 1" in err
    code, out, err = run_cli(capsys, *args, "--engine", "deepspeed", "--ep", 2)
    assert code != 0 and "no expert parallelism" in err and "Traceback" not in err


def test_expert_tp_token_gather_by_hand(h100_512, mixtral):
    """With tp > 1 Megatron's dispatcher all-gathers the received token copies over the experts'
    tp group before the experts and reduce-scatters after: top_k x 1.1 x the tokens at etp = tp,
    none at etp = 1; an MoE layer has no dense MLP, so the MLP half of the dense exchange (with
    megatron-core's 0.5 TP overlap) is taken back. Per pass: forward, backward, full recompute."""
    from plan3d.cost import comm
    from plan3d.cost.arrays import layout_arrays
    from plan3d.cost.core import Links, _expert_tp_gather_s

    ctx = make_context(h100_512, mixtral, TrainingSpec(global_batch=1024), load_engine(MEGATRON))
    bw, latency = 4e11, 2e-6
    links = Links({(group, op): (np.array([bw]), np.array([latency])) for group in ("tp", "etp")
                   for op in ("all_gather", "reduce_scatter", "all_reduce")})
    tokens = mixtral.seq_len * mixtral.hidden * 2
    routed = 2 * MOE_IMBALANCE * tokens

    def pair(size, n):
        return comm.all_gather_s(size, n, bw, latency) + comm.reduce_scatter_s(size, n, bw, latency)

    for recompute, passes in (("none", 2), ("full", 3)):
        la = layout_arrays(1024, [4], [1], [128], [1], [1], [1], [RECOMPUTE_CODES[recompute]], [1.0], [1], [8])
        got = _expert_tp_gather_s(ctx, la, links, la.recompute >= RECOMPUTE_CODES["full"])[0]
        assert got == pytest.approx(passes * (pair(routed, 4) - 0.5 * pair(tokens, 4)), rel=1e-12)
    folded = layout_arrays(1024, [4], [1], [128], [1], [1], [1], [0], [1.0], [1], [8], etp=[1])
    assert _expert_tp_gather_s(ctx, folded, links, np.array([False]))[0] == pytest.approx(-2 * 0.5 * pair(tokens, 4))
    half = layout_arrays(1024, [4], [1], [128], [1], [1], [1], [0], [1.0], [1], [8], etp=[2])
    assert _expert_tp_gather_s(ctx, half, links, np.array([False]))[0] == \
        pytest.approx(2 * (pair(routed / 2, 2) - 0.5 * pair(tokens, 4)))
    alone = layout_arrays(1024, [1], [1], [512], [1], [1], [1], [RECOMPUTE_CODES["none"]], [0.0], [1], [8])
    assert _expert_tp_gather_s(ctx, alone, links, np.array([False]))[0] == 0.0


def test_an_all_to_all_across_nodes_sends_what_stays_over_nvlink_and_what_leaves_over_the_nic():
    """By hand: 32 ranks, 8 per node, NVLink 360 GB/s and a 45 GB/s NIC share per GPU. Of the 31/32
    of its data a rank sends, 7/32 stays in the node (7/32 / 360e9 s per byte) and 24/32 leaves it
    (24/32 / 45e9 s per byte), at once: the NIC part is slower, so the effective bandwidth that
    prices 31/32 of the data is 31/24 x 45 GB/s. Inside one node it is the node's link."""
    from plan3d.cost.comm import all_to_all_bandwidth

    assert all_to_all_bandwidth(32, 8, 360e9, 45e9) == pytest.approx(31 / 24 * 45e9)
    assert all_to_all_bandwidth(8, 8, 360e9, 45e9) == pytest.approx(360e9)  # nothing leaves the node
    assert all_to_all_bandwidth(4, 1, 360e9, 45e9) == pytest.approx(45e9)  # one rank per node: all over the NIC


def test_a_stated_load_factor_replaces_the_prior_and_the_capacity(h100_512, mixtral):
    """MoESpec.load_factor is the busiest rank's load under dropless routing: 1.0 under forced balance
    (fewer routed tokens than the 1.1 prior: a faster step, fewer activations); a capacity factor pads
    every expert to it (what emit megatron writes), so it wins over a stated load."""
    from plan3d.cost.context import moe_load_factor

    def with_moe(**update):
        return mixtral.model_copy(update={"moe": mixtral.moe.model_copy(update=update)})

    assert moe_load_factor(mixtral) == MOE_IMBALANCE
    assert moe_load_factor(with_moe(capacity_factor=1.25)) == 1.25
    assert moe_load_factor(with_moe(capacity_factor=1.25, load_factor=1.0)) == 1.25
    assert moe_load_factor(with_moe(load_factor=1.3)) == 1.3
    training, layout = TrainingSpec(global_batch=512), Layout(tp=2, pp=4, dp=64, ep=8, sequence_parallel=True)
    engine = load_engine(MEGATRON)
    prior = estimate(h100_512, mixtral, training, layout, engine)
    even = estimate(h100_512, with_moe(load_factor=1.0), training, layout, engine)
    assert even.step_time_s < prior.step_time_s
    assert even.memory_bytes["activations"] < prior.memory_bytes["activations"]
    with pytest.raises(ValueError, match="load_factor"):
        with_moe(load_factor=0.5).model_validate(with_moe(load_factor=0.5).model_dump())


@pytest.mark.parametrize("kept_bytes", [0.0, 2.0, 4.0])
def test_the_combine_keeps_the_experts_output_at_the_engines_bytes(h100_512, mixtral, kept_bytes):
    """By hand: Mixtral tp2 pp4 ep8 sp without recompute, micro-batch 1 of 4,096 tokens. The
    experts' output before the combine, routed = top_k * s * 1.1 tokens x h, whole on every tp rank,
    is kept at `moe_combine_output_bytes` per element: rank 0 holds it for 8 layers x 4 micro-batches.
    Megatron-Core keeps none (its router probabilities scale the activation), torchtitan fp32."""
    training = TrainingSpec(global_batch=1024)
    layout = Layout(tp=2, pp=4, dp=64, ep=8, zero=1, recompute="none", sequence_parallel=True)
    base = load_engine(MEGATRON)

    def activations(stated):
        engine = base.model_copy(update={"runs_as": base.runs_as.model_copy(update={"moe_combine_output_bytes": stated})})
        est = estimate(h100_512, mixtral, training, layout, engine=engine)
        assert est.worst_pp_rank == 0
        return est.memory_bytes["activations"]

    routed = 2 * 4096 * MOE_IMBALANCE
    assert activations(kept_bytes) - activations(0.0) == pytest.approx(8 * 4 * routed * 4096 * kept_bytes, rel=1e-9)
    assert activations(None) == pytest.approx(activations(2.0), rel=1e-12)  # empty: the bf16 activation dtype


def test_megatron_core_keeps_no_combine_output_and_torchtitan_an_fp32_copy():
    """The profiles state what their code keeps (experts.py bias_act_func with permuted_probs; the
    torchtitan combine's routed_output.to(float32) * scores)."""
    assert load_engine("megatron-core").runs_as.moe_combine_output_bytes == 0
    assert load_engine("torchtitan").runs_as.moe_combine_output_bytes == 4
