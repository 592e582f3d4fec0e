"""What a Hugging Face config.json holds that the imported ModelSpec does not: one warning each, by
field name, saying what the spec assumes instead and what that leaves out. Nothing is dropped
silently (`plan3d import-hf` prints these and writes them into the spec file as comments).
"""
from __future__ import annotations

from typing import Any

from plan3d.specs.base import printable
from plan3d.specs.hf_details import QK_NORM_FAMILIES, rope_warning
from plan3d.specs.hf_moe import EXPERTS_FIELDS, MOE_FAMILIES, RULE_FIELDS, family, hf_moe_layers, is_moe, shown
from plan3d.specs.model import ModelSpec

ROUTING_DETAILS = ("topk_method",)  # norm_topk_prob, routed_scaling_factor, n_group, topk_group: MoESpec holds them


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _layer_list(layers: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, layers[:most]))
    return f"[{shown}{', ...' if len(layers) > most else ''}]"


def layer_rule_warning(config: dict, spec: ModelSpec) -> str | None:
    """Where the spec's MoE layers (i >= first_dense_layers, i % every == 0) differ from the config's."""
    if not is_moe(config):
        return None
    rule = RULE_FIELDS[family(config)["rule"]]
    hf = [i for i, routed in enumerate(hf_moe_layers(config, spec.layers, spec.name)) if routed]
    if spec.moe is None:
        return f"no layer routes to experts by {rule}: imported as a dense model"
    ours = [i for i in range(spec.layers) if spec.is_moe_layer(i)]
    if ours == hf:
        return None
    return (f"config.json routes {len(hf)} of {spec.layers} layers to experts ({rule}: layers {_layer_list(hf)}); "
            f"the spec's rule (i >= first_dense_layers {spec.moe.first_dense_layers} and i % every "
            f"{spec.moe.every} == 0) routes {_layer_list(ours)}: as many layers, so parameter counts agree, "
            "but a pipeline stage may hold different ones")


def mtp_warning(config: dict) -> str | None:
    depth = config.get("num_nextn_predict_layers")
    if not _positive_int(depth):
        return None
    return (f"num_nextn_predict_layers {depth}: the multi-token-prediction module (DeepSeek-V3, arXiv:2412.19437 "
            "section 2.2: per depth one more transformer block, a 2h x h projection and two norms, sharing the "
            "embedding and output head) is not in the spec; its parameters, memory and time are not counted")


def window_warnings(config: dict, spec: ModelSpec) -> list[str]:
    """Sliding-window (Mistral, gpt-oss) and chunked (Llama 4) attention shorter than seq_len."""
    found = []
    window = config.get("sliding_window")
    if _positive_int(window) and config.get("use_sliding_window") is not False and window < spec.seq_len:
        types = config.get("layer_types")
        count = sum(t == "sliding_attention" for t in types) if isinstance(types, list) else spec.layers
        found.append(f"sliding_window {window} on {count} of {spec.layers} layers: the spec has no sliding-window "
                     f"attention, so the cost model computes full causal attention over seq_len {spec.seq_len:,} "
                     "there (attention FLOPs and activation memory overestimated)")
    chunk = config.get("attention_chunk_size")
    if _positive_int(chunk) and chunk < spec.seq_len:
        found.append(f"attention_chunk_size {chunk}: Llama 4's chunked local attention is not in the spec; the cost "
                     f"model computes full causal attention over seq_len {spec.seq_len:,} on every layer")
    no_rope = config.get("no_rope_layers")
    if isinstance(no_rope, list) and 0 in no_rope:
        found.append(f"no_rope_layers: {no_rope.count(0)} of {len(no_rope)} layers use no positional encoding "
                     "(NoPE); the spec applies RoPE to every layer (no effect on parameters or the cost model)")
    return found


def parameter_warnings(config: dict, spec: ModelSpec) -> list[str]:
    """Small weights the spec's parameter count leaves out, with their count."""
    found = []
    model_type = str(config.get("model_type"))
    if model_type == "gpt_oss":
        sinks = spec.heads * spec.layers
        found.append(f"attention sinks (gpt-oss: one learned logit per head, {spec.heads} x {spec.layers} layers "
                     f"= {sinks:,} parameters) are not counted")
    if model_type in QK_NORM_FAMILIES:
        per_layer = 2 * spec.head_dim_
        found.append(f"q_norm/k_norm weights (qk_norm: true; {per_layer} per layer, {per_layer * spec.layers:,} "
                     "in all) are not in the parameter count")
    if config.get("topk_method") == "noaux_tc" and spec.moe is not None:
        bias = spec.moe.experts * spec.moe_layers
        found.append(f"topk_method 'noaux_tc': the expert bias of auxiliary-loss-free balancing "
                     f"(e_score_correction_bias, {spec.moe.experts} per MoE layer, {bias:,} in all) is not counted")
    return found


def behaviour_warnings(config: dict, spec: ModelSpec) -> list[str]:
    """Routing and activation details without parameters that the spec does not hold."""
    found = []
    if spec.moe is not None:
        details = [f"{k} {shown(config[k])}" for k in ROUTING_DETAILS if config.get(k) is not None]
        if details:
            found.append(f"routing details the spec does not hold (no parameters; the cost model spreads tokens "
                         f"evenly over the experts): {', '.join(details)}")
    if config.get("swiglu_limit") is not None:
        found.append(f"swiglu_limit {shown(config['swiglu_limit'])}: the clamped SwiGLU is modelled as plain "
                     "SwiGLU (the same parameters and FLOPs)")
    return found


def family_warning(config: dict) -> str | None:
    model_type = str(config.get("model_type"))
    if not is_moe(config) or model_type in MOE_FAMILIES:
        return None
    named = [f for f in EXPERTS_FIELDS if config.get(f) is not None]
    return (f"model_type {printable(model_type)[:60]!r} is not a mixture-of-experts family plan3d knows "
            f"({', '.join(MOE_FAMILIES)}); its experts were read from {', '.join(named)} and the generic "
            "field names: check the spec against the model card")


def unmodelled(config: dict, spec: ModelSpec) -> list[str]:
    """Every warning for what the config holds and the spec does not."""
    single = [family_warning(config), layer_rule_warning(config, spec), mtp_warning(config), rope_warning(config)]
    return ([w for w in single if w] + window_warnings(config, spec) + parameter_warnings(config, spec)
            + behaviour_warnings(config, spec))
