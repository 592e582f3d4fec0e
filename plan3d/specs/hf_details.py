"""Model details of a Hugging Face `config.json` that change what an engine builds without changing
its shapes: the norms' epsilon, q/k norms and RoPE scaling -> ModelSpec's `norm_eps`, `qk_norm`,
`rope_scaling`.

- Epsilon: `rms_norm_eps` (Llama, Qwen, Mistral, DeepSeek), `layer_norm_epsilon` (GPT-2, BLOOM),
  `layer_norm_eps` (GPT-NeoX, OPT's `layer_norm_elementwise_affine` family), `norm_epsilon`.
- Q/K norms: Qwen3 and OLMo 2 norm each head's query and key (`q_norm`/`k_norm`,
  `QK_NORM_FAMILIES`); DeepSeek-V2/V3's multi-head latent attention norms its query and key/value
  latents (`q_a_layernorm`, `kv_a_layernorm`), which Megatron-Core's `--qk-layernorm` builds for MLA.
- RoPE scaling (`rope_scaling`, transformers' modeling_rope_utils.py): `rope_type` (or the older
  `type`) "llama3" (Llama 3.1-3.3: factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings) and "yarn" (DeepSeek-V2/V3, Qwen long-context: factor,
  original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim); "default" is
  none. Other types (linear, dynamic, longrope) are not modelled: `rope_warning` names them.
- Dropout: the probabilities a config states (`DROPOUT_FIELDS`: Llama/Qwen/Mistral
  `attention_dropout`, BLOOM/Falcon `hidden_dropout`, GPT-2 `resid_pdrop`/`attn_pdrop`/
  `embd_pdrop`, BERT-style `hidden_dropout_prob`/`attention_probs_dropout_prob`, OPT `dropout`)
  -> ModelSpec's one `dropout`. None stated: 0 (the spec's default, what Llama, Mixtral and
  DeepSeek train with). Stated values that differ: the largest, with a warning naming each field,
  since the spec (and Megatron's `--hidden-dropout`/`--attention-dropout` as plan3d emits them)
  holds one value. A value that is not a probability in [0, 1) is refused, naming the field.
"""
from __future__ import annotations

from typing import Any

from plan3d.errors import SpecError
from plan3d.specs.base import printable

NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "olmo2")  # q_norm / k_norm RMSNorm(head_dim) in every layer
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                  "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout")
ROPE_TYPES = ("llama3", "yarn")
ROPE_FIELDS = {  # HF rope_scaling key -> RopeScaling field
    "factor": "factor", "original_max_position_embeddings": "original_max_position",
    "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
}
ROPE_TYPE_FIELDS = {"llama3": ("factor", "original_max_position", "low_freq_factor", "high_freq_factor"),
                    "yarn": ("factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}


def stated_dropouts(config: dict, source: str) -> dict[str, float]:
    """Each dropout probability the config states, by field; SpecError naming one that is not in [0, 1)."""
    stated = {k: config[k] for k in DROPOUT_FIELDS if config.get(k) is not None}
    bad = [f"{k}: {printable(str(v))[:40]!r} is not a dropout probability; give a number in [0, 1)"
           for k, v in stated.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1]
    if bad:
        raise SpecError(source, bad)
    return {k: float(v) for k, v in stated.items()}


def dropout_warning(config: dict, source: str) -> str | None:
    """A warning naming the fields when the config states differing dropouts (the spec keeps the largest)."""
    stated = stated_dropouts(config, source)
    if len(set(stated.values())) < 2:
        return None
    listed = ", ".join(f"{k} {v:g}" for k, v in stated.items())
    return (f"the config states different dropouts ({listed}); the spec holds one, the largest "
            f"({max(stated.values()):g}): edit `dropout` if the model trains otherwise")


def detail_fields(config: dict, model_type: str, rope: bool, mla: bool, source: str = "config.json") -> dict[str, Any]:
    """`norm_eps`, `qk_norm`, `rope_scaling` and `dropout` where the config states them (values of
    the wrong type are passed on for validation to name; a dropout outside [0, 1) is refused here)."""
    out: dict[str, Any] = {}
    dropouts = stated_dropouts(config, source)
    if dropouts:
        out["dropout"] = max(dropouts.values())
    eps = next((config[k] for k in NORM_EPS_FIELDS if config.get(k) is not None), None)
    if eps is not None:
        out["norm_eps"] = eps
    if model_type in QK_NORM_FAMILIES or mla:
        out["qk_norm"] = True
    scaling = rope_scaling_field(config.get("rope_scaling")) if rope else None
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _rope_type(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return None
    kind = raw.get("rope_type", raw.get("type"))
    return kind if isinstance(kind, str) else None


def rope_scaling_field(raw: Any) -> dict[str, Any] | None:
    """ModelSpec's `rope_scaling` for a llama3 or yarn `rope_scaling`; None for none or another type."""
    kind = _rope_type(raw)
    if kind not in ROPE_TYPES:
        return None
    keep = ROPE_TYPE_FIELDS[kind]
    fields = {ROPE_FIELDS[k]: v for k, v in raw.items() if k in ROPE_FIELDS and ROPE_FIELDS[k] in keep
              and v is not None}
    return {"type": kind, **fields}


def rope_warning(config: dict) -> str | None:
    """A `rope_scaling` of a type the spec does not hold, by name."""
    raw = config.get("rope_scaling")
    kind = _rope_type(raw)
    if raw is None or kind in ROPE_TYPES or kind == "default":
        return None
    return (f"rope_scaling type {printable(str(kind))[:40]!r} is not modelled (plan3d holds llama3 and yarn): "
            "the spec has plain RoPE at rope_theta; the engines will train the model without that scaling")
