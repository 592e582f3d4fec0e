"""torchtitan 0.3.0 jobs for mixture-of-experts plans: DeepSeek-V3-shaped models only.

torchtitan 0.3.0 builds MoE decoders only through its own recipes (models/*/__init__.py):
deepseek_v3 and kimi_k2_7 (multi-latent attention), qwen3 and qwen3_5 (QK-norm, hybrid
attention), gpt_oss (attention sinks, biases). A plan3d model spec with MLA, SwiGLU experts,
RMSNorm, RoPE and no biases is exactly what `deepseek_v3._build_dsv3_layers` (its
`build_mla_moe_layers` with DeepSeek-V3's initialisers) builds: the first `first_dense_layers`
layers dense, every later layer MoE, `num_shared_experts` shared experts of the routed expert's
width, a softmax or sigmoid top-k router (its weights renormalised, scaled and group-limited as the spec's
`normalize_top_k`, `top_k_scaling` and `router_groups` say). The job builds that model with the plan's shapes and
plain RoPE at the spec's rope_theta (`ComplexRoPE` scaling "none"; the recipes' YaRN is a
context-extension choice the spec does not make).

Expert parallelism (`parallelism.expert_parallel_degree`, distributed/parallel_dims.py): the
experts' mesh is (pp, dp_replicate, efsdp, ep) over the same ranks as (pp, dp_replicate,
dp_shard, cp, tp), efsdp = dp_shard * cp * tp / ep, ep fastest; expert weights are sharded over
ep only (models/common/moe_sharding.py `expert_param_placement_sparse`), over tp only when ep = 1
(`expert_param_placement_dense`). plan3d splits experts over tp and takes ep from dp*cp, so a
plan is written when ep = 1, or ep > 1 with tp = 1 and FSDP (ZeRO-2/3: dp_shard = dp); then
torchtitan's ep groups (consecutive ranks) and efsdp groups are plan3d's "ep" and "edp" groups.

Refused, naming the reason: MoE without MLA (no torchtitan decoder matches), experts not in
every layer after the dense ones (`every` > 1), shared experts that are not a whole number of
routed-expert widths, a shared-expert gate, a capacity factor (torchtitan's token-choice MoE is
dropless; `non_blocking_capacity_factor` sizes HybridEP buffers), ep > 1 with tp > 1 or ZeRO-0.
Load balancing is torchtitan's auxiliary-loss-free expert bias (`load_balance_coeff` 1e-3,
updated by `register_moe_load_balancing_hook`) for either router; a note says so.
"""
from __future__ import annotations

from plan3d.plan import Plan

RECIPE = "deepseek_v3_16b"  # models/deepseek_v3/config_registry.py: data set, optimizer and schedule
ROPE_THETA = 10000.0  # DeepSeek-V3's rope_theta, used when the spec gives none


def moe_problems(plan: Plan) -> list[str]:
    """Why torchtitan 0.3.0's deepseek_v3 builder cannot build this MoE plan (empty: it can)."""
    model, layout, moe = plan.model, plan.layout, plan.model.moe
    if moe is None:
        return ["its expert parallelism needs a MoE model; set ep=1"] if layout.ep > 1 else []
    if model.mla is None:
        return [f"its MoE decoders have MLA (deepseek_v3, kimi_k2_7), QK-norm (qwen3, qwen3_5) or attention "
                f"sinks (gpt_oss), and {model.name} has none of them"]
    out = []
    if moe.every != 1:
        out.append(f"its deepseek_v3 builder makes every layer after the first dense ones MoE; {model.name} has "
                   f"one every {moe.every}")
    width = moe.expert_ffn_hidden or model.ffn_hidden_
    if moe.shared_ffn_hidden % width:
        out.append(f"its shared experts are whole routed-expert widths ({width}); {model.name} shares "
                   f"{moe.shared_ffn_hidden}")
    if moe.shared_expert_gate:
        out.append("it has no shared-expert gate")
    if moe.capacity_factor is not None:
        out.append(f"its token-choice MoE is dropless; the spec has capacity_factor={moe.capacity_factor:g}")
    if layout.ep > 1 and layout.tp > 1:
        out.append(f"its expert_parallel_degree takes ranks from tp and keeps experts whole, where plan3d splits "
                   f"them over tp={layout.tp}: use tp=1 with ep > 1")
    if layout.ep > 1 and layout.zero < 2:
        out.append("its expert-parallel ranks come from data_parallel_shard_degree (FSDP): use ZeRO-2/3 with ep > 1")
    return out


def imports() -> list[str]:
    return ["import dataclasses", "",
            "import torchtitan.models.deepseek_v3 as deepseek_v3",
            "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
            f"from torchtitan.models.deepseek_v3.config_registry import {RECIPE} as recipe"]


def model_lines(plan: Plan, max_seq_len: int) -> list[str]:
    """The plan's DeepSeek-V3-shaped model through torchtitan's own deepseek_v3 builder."""
    model, moe, mla = plan.model, plan.model.moe, plan.model.mla
    dim, vocab = model.hidden, model.vocab
    width = moe.expert_ffn_hidden or model.ffn_hidden_
    lines = [
        "model = deepseek_v3.DeepSeekV3Model.Config(",
        f"    dim={dim}, vocab_size={vocab}, mtp_layers=[],",
        (f"    tok_embeddings=Embedding.Config(num_embeddings={vocab}, embedding_dim={dim}, "
         "param_init=deepseek_v3._EMBEDDING_INIT),"),
        f"    norm=RMSNorm.Config(normalized_shape={dim}, param_init=deepseek_v3._NORM_INIT),",
        (f"    lm_head=Linear.Config(in_features={dim}, out_features={vocab}, "
         f"param_init=deepseek_v3._output_linear_init({dim})),"),
        "    layers=deepseek_v3._build_dsv3_layers(",
        f"        n_layers={model.layers}, n_dense_layers={min(moe.first_dense_layers, model.layers)}, dim={dim},",
        f"        n_heads={model.heads}, q_lora_rank={mla.q_lora_rank or 0}, kv_lora_rank={mla.kv_lora_rank},",
        (f"        qk_nope_head_dim={mla.qk_nope_head_dim}, qk_rope_head_dim={mla.qk_rope_head_dim}, "
         f"v_head_dim={mla.v_head_dim}, mscale=1.0,"),
        f"        dense_hidden_dim={model.ffn_hidden_}, moe_hidden_dim={width}, num_experts={moe.experts},",
        (f"        num_shared_experts={moe.shared_ffn_hidden // width}, router_top_k={moe.top_k}, "
         f'router_score_func="{moe.router}",'),
        f"        {router_args(moe)},",
        '        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,',
        (f"        rope=ComplexRoPE.Config(dim={mla.qk_rope_head_dim}, max_seq_len={max_seq_len}, "
         f'theta={model.rope_theta or ROPE_THETA!r}, scaling="none"),'),
        "    ),",
        ")",
    ]
    if moe.shared_ffn_hidden == 0:
        lines += ["for layer in model.layers:  # no shared experts",
                  "    if layer.moe is not None:",
                  "        layer.moe.shared_experts = None"]
    return lines + [f'config.model_spec = dataclasses.replace(deepseek_v3.model_registry("debugmodel"), '
                    f'flavor="{model.name}", model=model)']


def router_args(moe) -> str:
    """The router's weights as the spec routes: renormalised top-k (route_norm; the builder's
    default is off), scaled (route_scale), group-limited (num_expert_groups / num_limited_groups)."""
    groups = (f"router_num_expert_groups={moe.router_groups}, router_num_limited_groups={moe.router_group_top_k}, "
              if moe.group_limited else "")
    return f"{groups}router_route_scale={float(moe.top_k_scaling or 1)!r}, router_route_norm={moe.normalize_top_k!r}"


def moe_notes(plan: Plan) -> list[str]:
    moe = plan.model.moe
    if moe is None:
        return []
    return [f"torchtitan balances the experts with its auxiliary-loss-free expert bias (load_balance_coeff 1e-3) "
            f"for the {moe.router} router; the model is built with deepseek_v3's builder (plain RoPE, no MTP), "
            f"point hf_assets_path at a tokenizer with {plan.model.vocab} tokens"]
