"""Hugging Face `config.json` -> ModelSpec, from a local file only (never the network).

Families differ in field names (GPT-2 `n_layer`/`n_embd`/`n_head`/`n_inner`, OPT `ffn_dim`, Llama
`num_hidden_layers`/`hidden_size`/`intermediate_size`/`num_key_value_heads`) and in what a config
leaves implicit (BLOOM has ALiBi and no position field; GPT-2 ties its embeddings by default).
`FAMILIES` holds those implicit facts per `model_type`; `ALIASES` the field names. A config of an
unknown `model_type` is read with the generic aliases and hints (`rms_norm_eps` -> RMSNorm,
`rope_theta` -> rotary positions); if a required field is missing the error names it and the
names that were looked for.

Approximations (all well under 1% of the parameters): Qwen2's q/k/v biases are dropped (bias is
one flag for every linear layer in ModelSpec), BLOOM's embedding LayerNorm and OPT's two extra
learned positions are not counted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from plan3d.errors import SpecError
from plan3d.specs.loader import read_mapping, validate
from plan3d.specs.model import ModelSpec

ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "n_embed"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"),
    "kv_heads": ("num_key_value_heads", "n_head_kv", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "head_dim": ("head_dim",),
    "activation": ("hidden_act", "activation_function", "hidden_activation"),
    "tied_embeddings": ("tie_word_embeddings",),
}
REQUIRED = ("layers", "hidden", "heads", "vocab", "seq_len")
_DECODER_ROPE = {"norm": "rmsnorm", "bias": False, "position": "rope", "tied_embeddings": False}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _DECODER_ROPE, "mistral": _DECODER_ROPE, "mixtral": _DECODER_ROPE, "qwen2": _DECODER_ROPE,
    "qwen2_moe": _DECODER_ROPE, "qwen3": _DECODER_ROPE,
    "gpt2": {"norm": "layernorm", "bias": True, "position": "learned", "tied_embeddings": True, "activation": "gelu"},
    "gpt_neox": {"norm": "layernorm", "bias": True, "position": "rope", "tied_embeddings": False},
    "opt": {"norm": "layernorm", "bias": True, "position": "learned", "tied_embeddings": True},
    # BLOOM: ALiBi, no position field; trained with 2048-token sequences (BigScience, arXiv:2211.05100)
    "bloom": {"norm": "layernorm", "bias": True, "position": "alibi", "tied_embeddings": True,
              "activation": "gelu", "seq_len": 2048},
}
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu",
               "gelu_fast": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_python": "gelu", "quick_gelu": "gelu"}


def _first(config: dict, field: str) -> Any:
    for key in ALIASES[field]:
        if config.get(key) is not None:
            return config[key]
    return None


def _text_config(config: dict) -> dict:
    """Multimodal configs nest the language model under `text_config`."""
    nested = config.get("text_config")
    if isinstance(nested, dict) and _first(config, "layers") is None:
        return {"model_type": config.get("model_type"), **nested}
    return config


def _generic_hints(config: dict) -> dict[str, Any]:
    """Implicit facts for a model_type plan3d does not know, read from tell-tale fields."""
    rope = any(k in config for k in ("rope_theta", "rotary_pct", "rotary_emb_base", "rope_scaling"))
    hints = {"norm": "rmsnorm" if "rms_norm_eps" in config else "layernorm",
             "position": "alibi" if config.get("alibi") else "rope" if rope else "learned"}
    hints["bias"] = bool(config.get("attention_bias", config.get("bias", hints["norm"] == "layernorm")))
    return hints


def _activation(config: dict, defaults: dict, source: str) -> str:
    raw = _first(config, "activation")
    if raw is None:
        return defaults.get("activation", "gelu")
    if not isinstance(raw, str) or raw not in ACTIVATIONS:
        raise SpecError(source, [f"activation {raw!r} is not one plan3d models; known: {', '.join(ACTIVATIONS)}"])
    return ACTIVATIONS[raw]


def _moe(config: dict) -> dict | None:
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        return None
    moe = {"experts": experts, "top_k": config.get("num_experts_per_tok", 2)}
    if config.get("moe_intermediate_size"):
        moe["expert_ffn_hidden"] = config["moe_intermediate_size"]
    return moe


def spec_fields(config: dict, source: str, name: str, seq_len: int | None = None) -> dict[str, Any]:
    """ModelSpec fields from a parsed config; SpecError listing every missing field."""
    if config.get("is_encoder_decoder"):
        raise SpecError(source, ["encoder-decoder models are not supported: plan3d plans decoder-only transformers"])
    config = _text_config(config)
    model_type = str(config.get("model_type", "unknown"))
    defaults = FAMILIES.get(model_type) or _generic_hints(config)
    found = {field: _first(config, field) for field in ALIASES}
    found["seq_len"] = seq_len or found["seq_len"] or defaults.get("seq_len")
    missing = [f for f in REQUIRED if found[f] is None]
    if missing:
        raise SpecError(source, [f"missing {f}: none of {', '.join(ALIASES[f])} is set (model_type {model_type!r})"
                                 + ("; pass --seq-len" if f == "seq_len" else "") for f in missing])
    fields = {k: defaults[k] for k in ("norm", "bias", "position", "tied_embeddings") if k in defaults}
    fields |= {k: v for k, v in found.items() if v is not None and k != "activation"}
    fields["activation"] = _activation(config, defaults, source)
    hidden, heads = fields["hidden"], fields["heads"]
    sizes_ok = all(isinstance(v, int) and v > 0 for v in (hidden, heads))  # else validation names the field
    if sizes_ok and fields.get("head_dim") == hidden // heads:
        del fields["head_dim"]  # the default: keep the spec minimal
    if _moe(config):
        fields["moe"] = _moe(config)
    return {"name": name, **fields, "source": f"Hugging Face config.json, model_type {model_type}"}


def default_name(path: Path, config: dict) -> str:
    """`_name_or_path` (its last part), else the folder holding config.json, else the model_type."""
    named = str(config.get("_name_or_path") or "").rstrip("/").split("/")[-1]
    folder = path.resolve().parent.name if path.name == "config.json" else path.stem
    return (named or folder or str(config.get("model_type", "model"))).lower()


def import_hf(path_str: str, name: str | None = None, seq_len: int | None = None) -> ModelSpec:
    """Read a Hugging Face config.json from disk and return the ModelSpec it describes."""
    path = Path(path_str)
    if path.is_dir() and (path / "config.json").is_file():  # a downloaded model folder
        path = path / "config.json"
    config = read_mapping(path)
    fields = spec_fields(config, path_str, name or default_name(path, config), seq_len)
    return validate(ModelSpec, fields, path_str)


def model_yaml(spec: ModelSpec, origin: str) -> str:
    """The spec as a YAML file a user can edit, with a header naming where it came from."""
    body = yaml.safe_dump(spec.model_dump(exclude_none=True), sort_keys=False)
    return f"# Imported by `plan3d import-hf` from {origin}; check it and cite the model card.\n{body}"
