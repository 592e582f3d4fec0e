"""Mixture-of-experts and multi-head latent attention in a Hugging Face `config.json` -> `MoESpec`, `MLASpec`.

Each family names the same facts differently (Hugging Face transformers' modeling code is the
reference for what the fields mean):

- Mixtral (`mixtral`; Jiang et al. 2024, arXiv:2401.04088): `num_local_experts` experts of width
  `intermediate_size`, `num_experts_per_tok` per token, every layer routed, no shared expert.
- Qwen2-MoE (`qwen2_moe`; Qwen2 report, arXiv:2407.10671): `num_experts` of `moe_intermediate_size`,
  one shared expert of `shared_expert_intermediate_size` scaled by a sigmoid gate h -> 1
  (`shared_expert_gate`); layer i routes when i is not in `mlp_only_layers` and
  (i + 1) % `decoder_sparse_step` == 0, the others keep a dense MLP of `intermediate_size`.
- Qwen3-MoE (`qwen3_moe`; arXiv:2505.09388): the same layer rule, no shared expert.
- DeepSeek-V2/V3 (`deepseek_v2`, `deepseek_v3`; arXiv:2405.04434, 2412.19437): `n_routed_experts`
  of `moe_intermediate_size`, `n_shared_experts` shared experts of that width; layer i routes when
  i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0 (MoESpec's own rule); router
  `scoring_func` softmax (V2) or sigmoid (V3); multi-head latent attention (`kv_lora_rank`, ...).
- gpt-oss (`gpt_oss`; OpenAI, arXiv:2508.10925): `num_local_experts` of `intermediate_size`,
  `experts_per_token` per token, every layer routed; biases on every linear layer, the router's too.
- Llama 4 (`llama4`, `llama4_text`): `num_local_experts` of `intermediate_size` plus one shared
  expert of the same width in every MoE layer; the MoE layers are `moe_layers` (default: every
  `interleave_moe_layer_step`-th, (i + 1) % step == 0); dense layers an MLP of
  `intermediate_size_mlp`; the router is a sigmoid of the top-k logits.

HF layer rules that MoESpec's (i >= first_dense_layers and i % every == 0) cannot express exactly
(Qwen's (i + 1) % step, an arbitrary `mlp_only_layers`) are imported with the same number of MoE
layers, so parameter counts agree, and `layer_rule_warning` says where the layers differ.
"""
from __future__ import annotations

import json
import math
from typing import Any

from plan3d.errors import SpecError
from plan3d.specs.base import printable
from plan3d.specs.model import ModelSpec

EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token")
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # q_lora_rank may be null

# model_type -> how its MoE is written: which layers route ("rule"), the shared experts ("shared"),
# whether the top-k weights are renormalised when the config has no `norm_topk_prob` ("norm": the
# Hugging Face config class's default, or what its modeling code always does: Mixtral and gpt-oss
# renormalise, Llama 4 routes one expert through a sigmoid)
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"rule": "every", "shared": "none", "norm": True},
    "gpt_oss": {"rule": "every", "shared": "none", "norm": True},
    "qwen2_moe": {"rule": "qwen", "shared": "qwen", "norm": False},
    "qwen3_moe": {"rule": "qwen", "shared": "none", "norm": False},
    "deepseek_v2": {"rule": "deepseek", "shared": "deepseek", "norm": False},
    "deepseek_v3": {"rule": "deepseek", "shared": "deepseek", "norm": True},
    "llama4": {"rule": "llama4", "shared": "llama4", "norm": False},
    "llama4_text": {"rule": "llama4", "shared": "llama4", "norm": False},
}
RULE_FIELDS = {"every": "every layer", "qwen": "decoder_sparse_step / mlp_only_layers",
               "deepseek": "first_k_dense_replace / moe_layer_freq",
               "llama4": "moe_layers / interleave_moe_layer_step"}
ROUTERS = {"softmax": "softmax", "sigmoid": "sigmoid"}
MAX_LAYERS = 100_000  # ModelSpec.layers' bound: a larger value is refused by validation, never looped over


def shown(value: Any) -> str:
    """A config value as a message shows it: as JSON writes it, control characters escaped, at most 40 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not JSON data (a caller's dict): Python's spelling
        text = repr(value)
    return printable(text)[:40]


def _present(config: dict, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """The first of `names` the config sets (not null), with its value."""
    for name in names:
        if config.get(name) is not None:
            return name, config[name]
    return None


def _whole(config: dict, name: str, source: str, default: int | None = None, least: int = 0) -> int | None:
    """An integer field (not a bool) of at least `least`, or `default` when unset."""
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SpecError(source, [f"{name} {shown(value)} is not a whole number >= {least}"])
    return value


def family(config: dict) -> dict[str, Any]:
    """The family's way of writing its MoE; an unknown model_type is read from the fields it has."""
    known = MOE_FAMILIES.get(str(config.get("model_type")))
    if known:
        return known
    if "first_k_dense_replace" in config or "moe_layer_freq" in config:
        rule = "deepseek"
    elif "decoder_sparse_step" in config or "mlp_only_layers" in config:
        rule = "qwen"
    elif "moe_layers" in config or "interleave_moe_layer_step" in config:
        rule = "llama4"
    else:
        rule = "every"
    return {"rule": rule, "shared": "generic"}


def is_moe(config: dict) -> bool:
    found = _present(config, EXPERTS_FIELDS)
    return found is not None and found[1] not in (0, 1)  # Mixtral-style configs of dense models say 1 or 0


def hf_moe_layers(config: dict, layers: int, source: str) -> list[bool]:
    """Which layers route to experts, by the config's own rule (HF transformers' modeling code)."""
    rule = family(config)["rule"]
    if rule == "deepseek":
        first = _whole(config, "first_k_dense_replace", source, 0)
        every = _whole(config, "moe_layer_freq", source, 1, least=1)
        return [i >= first and i % every == 0 for i in range(layers)]
    if rule == "qwen":
        step = _whole(config, "decoder_sparse_step", source, 1, least=1)
        dense = set(_layer_list(config, "mlp_only_layers", layers, source) or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if rule == "llama4":
        listed = _layer_list(config, "moe_layers", layers, source)
        if listed is not None:
            routed = set(listed)
            return [i in routed for i in range(layers)]
        step = _whole(config, "interleave_moe_layer_step", source, 1, least=1)
        return [(i + 1) % step == 0 for i in range(layers)]
    return [True] * layers


def _layer_list(config: dict, name: str, layers: int, source: str) -> list[int] | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                              for i in value):
        raise SpecError(source, [f"{name} must list layer indices from 0 to {layers - 1}"])
    return value


def layer_rule(flags: list[bool]) -> tuple[int, int]:
    """(first_dense_layers, every) whose rule routes exactly the layers `flags` marks, or failing
    that the same number of layers: the config's stride first (a shift of the pattern), else the
    last layers (every 1)."""
    routed = [i for i, f in enumerate(flags) if f]
    count, layers = len(routed), len(flags)
    strides = [routed[1] - routed[0]] if count > 1 else range(1, layers + 1)
    for every in strides:
        if _rule_layers(routed[0], every, layers) == routed:
            return routed[0], every
    for every in (strides[0], 1):
        start = math.ceil(layers / every) - count  # the index, in multiples of `every`, of the first MoE layer
        if start >= 0 and len(_rule_layers(start * every, every, layers)) == count:
            return start * every, every
    raise AssertionError("every 1 always fits a count")


def _rule_layers(first_dense: int, every: int, layers: int) -> list[int]:
    """MoESpec's rule: i >= first_dense_layers and i % every == 0."""
    start = math.ceil(first_dense / every) * every
    return list(range(start, layers, every))


def _shared(config: dict, kind: str, expert_width: int, source: str) -> tuple[int, bool]:
    """(total width of the shared experts, whether a sigmoid gate scales them)."""
    if kind == "none":
        return 0, False
    if kind == "llama4":
        return expert_width, False
    if kind == "qwen":
        width = _whole(config, "shared_expert_intermediate_size", source, 0)
        return width, width > 0  # HF Qwen2MoeSparseMoeBlock: the gate scales the shared expert's output
    shared_width = _whole(config, "shared_expert_intermediate_size", source, 0)
    if shared_width:  # a generic family that writes it Qwen's way
        return shared_width, False
    width = _whole(config, "moe_intermediate_size", source, expert_width, least=1)
    return _whole(config, "n_shared_experts", source, 0) * width, False


def _router(config: dict, model_type: str, source: str) -> str:
    raw = config.get("scoring_func")
    if raw is None:
        return "sigmoid" if model_type.startswith("llama4") else "softmax"
    if not isinstance(raw, str) or raw not in ROUTERS:
        raise SpecError(source, [f"scoring_func {shown(raw)} is not a router plan3d models; known: {', '.join(ROUTERS)}"])
    return ROUTERS[raw]


def moe_fields(config: dict, model_type: str, layers: Any, dense_width: Any, source: str) -> dict[str, Any]:
    """ModelSpec fields for the config's MoE (`moe`, and `ffn_hidden` where the dense MLP has its
    own field); {} for a dense model, or when `layers` is invalid (validation names it)."""
    if not is_moe(config) or not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= MAX_LAYERS:
        return {}
    name, experts = _present(config, EXPERTS_FIELDS)
    top_k = _present(config, TOP_K_FIELDS)
    if top_k is None:
        raise SpecError(source, [f"{name} {shown(experts)} without {' or '.join(TOP_K_FIELDS)}: the routed experts "
                                 "per token are unknown; add it to the config"])
    kind = family(config)
    fields: dict[str, Any] = {}
    if kind["shared"] == "llama4":
        fields["ffn_hidden"] = dense_width = _whole(config, "intermediate_size_mlp", source, dense_width, least=1)
    expert_width = _whole(config, "moe_intermediate_size", source, None, least=1) or \
        _whole(config, "intermediate_size", source, None, least=1)
    shared_width, gate = _shared(config, kind["shared"], expert_width or 0, source)
    flags = hf_moe_layers(config, layers, source)
    if not any(flags):
        return fields  # no layer routes: a dense model (hf_unmodelled.layer_rule_warning says so)
    first_dense, every = layer_rule(flags)
    moe = {"experts": experts, "top_k": top_k[1], "shared_ffn_hidden": shared_width, "shared_expert_gate": gate,
           "every": every, "first_dense_layers": first_dense, "router": _router(config, model_type, source)}
    if expert_width is not None and expert_width != dense_width:
        moe["expert_ffn_hidden"] = expert_width
    moe = {k: v for k, v in moe.items() if v or k in ("experts", "top_k")}
    return fields | {"moe": moe | routing_fields(config, kind, top_k[1])}


def routing_fields(config: dict, kind: dict, top_k: Any) -> dict[str, Any]:
    """The routing weights: renormalised (`norm_topk_prob`, else the family's default), scaled
    (`routed_scaling_factor`), group-limited (`n_group` > 1 with `topk_group`). Values of the wrong
    type are passed on for validation to name."""
    out: dict[str, Any] = {}
    normalized = config.get("norm_topk_prob", kind.get("norm", True))
    if normalized is False and top_k != 1:  # one expert: nothing to renormalise
        out["normalize_top_k"] = False
    elif normalized is not True and normalized is not False:
        out["normalize_top_k"] = normalized
    scale = config.get("routed_scaling_factor")
    if scale is not None and scale != 1:
        out["top_k_scaling"] = scale
    groups = config.get("n_group")
    if groups not in (None, 1):
        out["router_groups"], out["router_group_top_k"] = groups, config.get("topk_group")
    return out


def mla_fields(config: dict, source: str) -> dict[str, Any]:
    """`mla` for a config with multi-head latent attention (`kv_lora_rank` set); {} otherwise."""
    if config.get("kv_lora_rank") is None:
        return {}
    missing = [f for f in MLA_FIELDS if config.get(f) is None]
    if missing:
        raise SpecError(source, [f"kv_lora_rank is set (multi-head latent attention) but {', '.join(missing)} "
                                 "is not; the attention shape is unknown"])
    return {"mla": {"q_lora_rank": config.get("q_lora_rank"), **{f: config[f] for f in MLA_FIELDS}}}
