"""Megatron-Core's module recompute `moe-act` (`--recompute-granularity selective --recompute-modules
moe_act layernorm`): what it frees, what it costs, where it may be searched and what emit writes
(docs/cost-model.md, Memory)."""
from __future__ import annotations

import pytest

from plan3d.cost.estimate import estimate
from plan3d.emit.megatron import emit_megatron, megatron_args
from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems, recompute_modes
from plan3d.plan import build_plan
from plan3d.search import Space, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import MLASpec, ModelSpec, MoESpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_MODES

GIB = 2**30


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-h100", 8)  # 64 H100


def _layout(recompute: str) -> Layout:
    return Layout(tp=2, pp=4, dp=8, ep=8, micro_batch=1, zero=1, recompute=recompute, sequence_parallel=True)


def _estimate(cluster, model, recompute, engine="megatron-core"):
    training = TrainingSpec(global_batch=256)
    return estimate(cluster, model, training, _layout(recompute), engine=load_engine(engine)).to_dict()


def test_moe_act_frees_the_expert_activation_and_the_pre_mlp_norm_output_of_every_layer_in_flight(cluster, mixtral):
    """By hand: Mixtral (SwiGLU, top-2 of 8 experts, expert FFN 14336, h 4096, 32 layers all MoE),
    tp2 pp4 sp, micro-batch 1 of 4096 tokens, bf16. Per MoE layer and micro-batch moe-act drops the
    activation output of the routed tokens' expert FFN, top_k * s * load * ffn / tp elements, and the
    pre-MLP norm output, s * h / tp elements (sequence parallel), 2 bytes each. Pipeline rank 0 holds
    8 layers of pp = 4 micro-batches in flight (1F1B)."""
    none, act = _estimate(cluster, mixtral, "none"), _estimate(cluster, mixtral, "moe-act")
    s, h, ffn, top_k, tp = 4096, mixtral.hidden, mixtral.moe.expert_ffn_hidden or mixtral.ffn_hidden_, 2, 2
    load = 1.1  # the stated imbalance prior on the busiest rank (docs/cost-model.md, Mixture of experts)
    per_layer = (top_k * s * load * ffn / tp + s * h / tp) * 2
    layers, in_flight = mixtral.layers // 4, 4
    freed = none["memory_bytes"]["activations"] - act["memory_bytes"]["activations"]
    assert freed == pytest.approx(layers * in_flight * per_layer, rel=1e-6)
    assert freed > 4 * GIB  # of the order that decides whether a layout fits (4.35 GiB here)


def test_moe_act_costs_memory_bound_time_only(cluster, mixtral):
    """Its recompute pass is element-wise (the SwiGLU product from its two inputs, the norm from its
    input): more than nothing, far less than selective's attention core or a full forward; it adds
    no FLOPs, so MFU and HFU stay those of no recompute."""
    none, act = _estimate(cluster, mixtral, "none"), _estimate(cluster, mixtral, "moe-act")
    full = _estimate(cluster, mixtral, "full")
    assert 0 < act["time_s"]["recompute"] < 0.05 * full["time_s"]["recompute"]
    assert act["step_time_s"] < full["step_time_s"]
    for flops in ("hfu", "mfu"):  # utilisation x time: the FLOPs counted, the same without and with moe-act
        assert act[flops] * act["step_time_s"] == pytest.approx(none[flops] * none["step_time_s"], rel=1e-9)
    assert full["hfu"] * full["step_time_s"] > 1.2 * none["hfu"] * none["step_time_s"]  # full's pass is counted


def test_moe_act_is_refused_for_a_dense_model_not_with_fp8():
    gpt = load_model("gpt3-175b")
    layout = Layout(tp=8, pp=8, dp=8, micro_batch=1, recompute="moe-act", sequence_parallel=True)
    problems = layout_problems(layout, gpt, TrainingSpec(global_batch=1536), 512)
    assert any("dense" in p and "moe-act" in p for p in problems)
    mixtral = load_model("mixtral-8x7b")
    assert not layout_problems(_layout("moe-act"), mixtral, TrainingSpec(global_batch=256, precision="fp8"), 64)
    assert "moe-act" not in recompute_modes(RECOMPUTE_MODES, gpt, TrainingSpec(global_batch=1536))


@pytest.mark.parametrize("mode", ["moe-act", "moe"])
def test_the_search_offers_module_recompute_only_where_the_engine_runs_it_and_the_model_has_experts(
        cluster, mixtral, mode):
    training = TrainingSpec(global_batch=256)
    space = Space(max_micro_batch=1, max_vpp=1)
    moe = search(cluster, mixtral, training, space, engine=load_engine("megatron-core"))
    assert mode in {moe.layout(i).recompute for i in range(moe.size)}
    titan = search(cluster, mixtral, training, space, engine=load_engine("torchtitan"))
    assert mode not in {titan.layout(i).recompute for i in range(titan.size)}
    dense = search(cluster, load_model("llama3-8b"), TrainingSpec(global_batch=64), space,
                   engine=load_engine("megatron-core"))
    assert mode not in {dense.layout(i).recompute for i in range(dense.size)}
    with pytest.raises(LayoutError, match="dense"):
        search(cluster, load_model("llama3-8b"), TrainingSpec(global_batch=64), Space(recompute=(mode,)))
    problems = layout_problems(Layout(tp=8, pp=8, dp=8, recompute=mode, sequence_parallel=True),
                               load_model("gpt3-175b"), TrainingSpec(global_batch=1536), 512)
    assert any("dense" in p and f"recompute {mode}" in p for p in problems)


def test_emit_megatron_writes_the_recompute_modules(cluster, mixtral):
    plan = build_plan(cluster, mixtral, TrainingSpec(global_batch=256), _layout("moe-act"),
                      engine=load_engine("megatron-core"))
    args = megatron_args(plan)
    at = args.index("--recompute-modules")
    assert args[at - 2:at] == ["--recompute-granularity", "selective"]
    assert args[at + 1:at + 3] == ["moe_act", "layernorm"] and "--moe-grouped-gemm" in args


def test_moe_recompute_frees_the_moe_block_of_every_layer_in_flight_but_one(cluster, mixtral):
    """By hand, the case above with `--recompute-modules moe layernorm`: MoELayer.forward runs under
    one checkpoint, so per MoE layer and micro-batch the routed experts' FFN tensors (SwiGLU: the
    gate and up outputs and their product, 3 x routed * ffn / tp, routed = top_k * s * load), the
    permuted input tokens (routed * h: Megatron-Core's combine keeps no output), the
    router's logits and probabilities (2 * s * experts / tp, sequence parallel) and the pre-MLP
    norm output (s * h / tp) are dropped, 2 bytes each; one layer's block is live again while its
    backward recomputes it. Rank 0 holds 8 layers x 4 micro-batches."""
    none, block = _estimate(cluster, mixtral, "none"), _estimate(cluster, mixtral, "moe")
    assert none["worst_pp_rank"] == block["worst_pp_rank"] == 0
    s, h, ffn, top_k, tp, experts = 4096, mixtral.hidden, mixtral.moe.expert_ffn_hidden or mixtral.ffn_hidden_, 2, 2, 8
    routed = top_k * s * 1.1
    per_layer = (3 * routed * ffn / tp + routed * h + 2 * s * experts / tp + s * h / tp) * 2
    freed = none["memory_bytes"]["activations"] - block["memory_bytes"]["activations"]
    assert freed == pytest.approx((8 * 4 - 1) * per_layer, rel=1e-6)
    act = _estimate(cluster, mixtral, "moe-act")
    assert block["memory_bytes"]["activations"] < act["memory_bytes"]["activations"]


def test_moe_recompute_repeats_the_block_and_its_all_to_alls(cluster, mixtral):
    """The recompute pass reruns the MoE block (more than moe-act's elementwise pass, less than a
    full forward) and its dispatch and combine: four all-to-alls per layer and micro-batch become
    six (forward, recompute, backward). Its expert GEMMs are hardware FLOPs, not model FLOPs."""
    none, block = _estimate(cluster, mixtral, "none"), _estimate(cluster, mixtral, "moe")
    act, full = _estimate(cluster, mixtral, "moe-act"), _estimate(cluster, mixtral, "full")
    assert act["time_s"]["recompute"] < block["time_s"]["recompute"] < full["time_s"]["recompute"]
    assert block["time_s"]["ep_comm"] == pytest.approx(1.5 * none["time_s"]["ep_comm"], rel=1e-9)
    assert block["mfu"] * block["step_time_s"] == pytest.approx(none["mfu"] * none["step_time_s"], rel=1e-9)
    assert block["hfu"] * block["step_time_s"] > 1.05 * none["hfu"] * none["step_time_s"]


def test_emit_megatron_writes_the_moe_module_and_a_recipe_megatron_takes_with_fp8(cluster, mixtral):
    plan = build_plan(cluster, mixtral, TrainingSpec(global_batch=256), _layout("moe"),
                      engine=load_engine("megatron-core"))
    args = megatron_args(plan)
    at = args.index("--recompute-modules")
    assert args[at - 2:at] == ["--recompute-granularity", "selective"] and args[at + 1:at + 3] == ["moe", "layernorm"]
    fp8 = build_plan(cluster, mixtral, TrainingSpec(global_batch=256, precision="fp8"), _layout("moe"),
                     engine=load_engine("megatron-core"))
    emitted = emit_megatron(fp8)
    assert megatron_args(fp8)[megatron_args(fp8).index("--fp8-recipe") + 1] == "tensorwise"
    assert any("--fp8-recipe tensorwise" in n and "Transformer Engine >= 2.6" in n for n in emitted.notes)
    plain = build_plan(cluster, mixtral, TrainingSpec(global_batch=256, precision="fp8"), _layout("none"),
                       engine=load_engine("megatron-core"))
    assert megatron_args(plain)[megatron_args(plain).index("--fp8-recipe") + 1] == "delayed"


def test_fp8_saves_an_moe_layers_gemm_inputs_in_one_byte(cluster, mixtral):
    """By hand, the case above in fp8 without recompute: per MoE layer and micro-batch Transformer
    Engine keeps the FP8 casts of the QKV input (s h / tp under SP), the projection input
    (s q_dim / tp) and the routed experts' FC1 input (routed x h): one byte less per element than
    bf16; rank 0 holds 8 layers x 4 micro-batches."""
    def activations(precision, recompute="none"):
        est = estimate(cluster, mixtral, TrainingSpec(global_batch=256, precision=precision), _layout(recompute),
                       engine=load_engine("megatron-core"))
        return est.memory_bytes["activations"], est.worst_pp_rank

    (bf16, rank_b), (fp8, rank_f) = activations("bf16"), activations("fp8")
    assert rank_b == rank_f == 0
    s, h, tp, q_dim = 4096, mixtral.hidden, 2, mixtral.heads * mixtral.head_dim_
    per_layer = s * h / tp + s * q_dim / tp + 2 * s * 1.1 * h
    assert bf16 - fp8 == pytest.approx(8 * 4 * per_layer, rel=1e-6)
    block_b, block_f = activations("bf16", "moe")[0], activations("fp8", "moe")[0]
    assert block_b - block_f == pytest.approx(8 * 4 * (s * h / tp + s * q_dim / tp), rel=1e-6)  # FC1 input dropped


# a small MLA MoE model: 4 heads of nope 32 + rope 16 (values 32), latents q 64 / kv 32, first layer dense
SMALL_MLA = ModelSpec(name="small-mla", layers=4, hidden=256, heads=4, vocab=512, seq_len=1024, activation="swiglu",
                      norm="rmsnorm", position="rope", bias=False, ffn_hidden=512,
                      mla=MLASpec(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                  v_head_dim=32),
                      moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=64, first_dense_layers=1))


def _mla(recompute: str) -> dict:
    cluster = load_cluster("dgx-h100", 1)
    layout = Layout(tp=2, pp=1, dp=4, ep=4, micro_batch=1, zero=1, recompute=recompute, sequence_parallel=True)
    return estimate(cluster, SMALL_MLA, TrainingSpec(global_batch=8), layout, engine=load_engine("megatron-core")).to_dict()


def test_mla_up_frees_the_per_head_qkv_of_every_layer_beyond_moe_act():
    """By hand: mla-up drops what moe-act drops (the experts' activation output, the pre-MLP norm
    output, and for MLA the separate input norm's output) and, in every layer, the per-head Q (4 x
    48), K (4 x 48) and V (4 x 32) the up-projections build: s (q + 2 kv) / tp elements of 2 bytes,
    one micro-batch in flight (pp 1) of 4 layers."""
    act, up = _mla("moe-act"), _mla("mla-up")
    s, tp, per_head_qkv = 1024, 2, 4 * 48 + 4 * (48 + 32)
    freed = act["memory_bytes"]["activations"] - up["memory_bytes"]["activations"]
    assert freed == pytest.approx(SMALL_MLA.layers * s * per_head_qkv / tp * 2, rel=1e-6)
    assert up["time_s"]["recompute"] > act["time_s"]["recompute"] and up["hfu"] > act["hfu"]


def test_mla_up_needs_mla_and_is_what_emit_megatron_writes():
    problems = layout_problems(Layout(recompute="mla-up"), load_model("mixtral-8x7b"), TrainingSpec(global_batch=8), 1)
    assert any("has no MLA" in p for p in problems)
    cluster = load_cluster("dgx-h100", 1)
    layout = Layout(tp=2, pp=1, dp=4, ep=4, micro_batch=1, zero=1, recompute="mla-up", sequence_parallel=True)
    plan = build_plan(cluster, SMALL_MLA, TrainingSpec(global_batch=8), layout, engine=load_engine("megatron-core"))
    args = megatron_args(plan)
    at = args.index("--recompute-modules")
    assert args[at + 1:at + 4] == ["mla_up_proj", "moe_act", "layernorm"]
    assert "mla-up" in recompute_modes(RECOMPUTE_MODES, SMALL_MLA, TrainingSpec(global_batch=8))
    assert "mla-up" not in recompute_modes(RECOMPUTE_MODES, load_model("mixtral-8x7b"), TrainingSpec(global_batch=8))
