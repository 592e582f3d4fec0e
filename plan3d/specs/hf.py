"""Hugging Face `config.json` -> ModelSpec, from a local file only (never the network).

Families differ in field names (GPT-2 `n_layer`/`n_embd`/`n_head`/`n_inner`, OPT `ffn_dim`, Llama
`num_hidden_layers`/`hidden_size`/`intermediate_size`/`num_key_value_heads`) and in what a config
leaves implicit (BLOOM has ALiBi and no position field; GPT-2 ties its embeddings by default).
`FAMILIES` holds those implicit facts per `model_type`; `ALIASES` the field names. A config of an
unknown `model_type` is read with the generic aliases and hints (`rms_norm_eps` -> RMSNorm,
`rope_theta` -> rotary positions); if a required field is missing the error names it and the
names that were looked for. A rotary model keeps its base (`rope_theta`, GPT-NeoX
`rotary_emb_base`) as the spec's `rope_theta`.

The training sequence length is a choice, not a config fact: `max_position_embeddings` is the
longest context a model accepts (131,072 for Llama-3.1, reached by long-context extension), not
the length it is trained at. Without `--seq-len` the import takes min(max_position_embeddings,
8192): 8192 is Llama 3's pretraining length and the bundled Llama specs' (GPT-3 and BLOOM state
2048 and keep it; Qwen2.5 and DeepSeek-V3 pretrained at 4096: pass --seq-len 4096), so an
imported Llama plans as the bundled one does; a config that states a shorter context keeps it. The
import says which it chose (`read_hf` returns the notes) and how to change it.

Mixture-of-experts models (Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2/V3, gpt-oss, Llama 4) import their
experts, shared experts, dense layers and router into `moe`, and DeepSeek's multi-head latent
attention into `mla` (`hf_moe`); what a config holds that the spec cannot (multi-token prediction,
sliding windows, attention sinks, routing details) is returned as warnings by name (`hf_unmodelled`).

Biases: ModelSpec's `qkv_bias` covers the Q/K/V projections and `bias` the attention output and
the MLP together, so Qwen2 (Q/K/V biases only) imports exactly as `bias: false, qkv_bias: true`.
Approximations (all well under 1% of the parameters): a model with an attention-output bias but
no MLP bias, or the reverse, is imported with `bias: false` and a warning naming what is left
out; BLOOM's embedding LayerNorm and OPT's two extra learned positions are not counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from plan3d.errors import SpecError, SpecNotFound
from plan3d.specs.base import printable
from plan3d.specs.hf_details import detail_fields, dropout_warning
from plan3d.specs.hf_moe import mla_fields, moe_fields
from plan3d.specs.hf_unmodelled import unmodelled
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
    "rope_theta": ("rope_theta", "rotary_emb_base"),  # RoPE base (Llama 3: 500000; GPT-NeoX: rotary_emb_base)
}
REQUIRED = ("layers", "hidden", "heads", "vocab")  # seq_len is a training choice: DEFAULT_SEQ_LEN
_DECODER_ROPE = {"norm": "rmsnorm", "bias": False, "position": "rope", "tied_embeddings": False}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _DECODER_ROPE, "mistral": _DECODER_ROPE, "mixtral": _DECODER_ROPE, "qwen2": _DECODER_ROPE,
    "qwen2_moe": _DECODER_ROPE, "qwen3": _DECODER_ROPE, "qwen3_moe": _DECODER_ROPE,
    "deepseek_v2": _DECODER_ROPE, "deepseek_v3": _DECODER_ROPE, "llama4": _DECODER_ROPE, "llama4_text": _DECODER_ROPE,
    # gpt-oss: biases on q/k/v, the attention output, the experts and the router (HF GptOssAttention, GptOssExperts)
    "gpt_oss": {"norm": "rmsnorm", "bias": True, "position": "rope", "tied_embeddings": False},
    "gpt2": {"norm": "layernorm", "bias": True, "position": "learned", "tied_embeddings": True, "activation": "gelu"},
    "gpt_neox": {"norm": "layernorm", "bias": True, "position": "rope", "tied_embeddings": False},
    "opt": {"norm": "layernorm", "bias": True, "position": "learned", "tied_embeddings": True},
    # BLOOM: ALiBi, no position field; trained with 2048-token sequences (BigScience, arXiv:2211.05100)
    "bloom": {"norm": "layernorm", "bias": True, "position": "alibi", "tied_embeddings": True,
              "activation": "gelu", "seq_len": 2048},
}
DEFAULT_SEQ_LEN = 8192  # Llama 3's pretraining length, as the bundled Llama specs; see the module docstring
QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")  # HF Qwen2Attention: bias on q/k/v_proj, none on o_proj or the MLP
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


@dataclass(frozen=True)
class HfImport:
    """The imported spec and what the user should know about the choices made for them."""

    spec: ModelSpec
    notes: list[str]  # choices made for the user (the training sequence length)
    warnings: list[str]  # what the spec cannot represent


def spec_fields(config: dict, source: str, name: str, seq_len: int | None = None) -> dict[str, Any]:
    """ModelSpec fields from a parsed config; SpecError listing every missing field."""
    if config.get("is_encoder_decoder"):
        raise SpecError(source, ["encoder-decoder models are not supported: plan3d plans decoder-only transformers"])
    config = _text_config(config)
    model_type = str(config.get("model_type", "unknown"))
    defaults = FAMILIES.get(model_type) or _generic_hints(config)
    _check_context(config, source)
    found = {field: _first(config, field) for field in ALIASES}
    found["seq_len"] = seq_len or _default_seq_len(config, defaults)
    missing = [f for f in REQUIRED if found[f] is None]
    if missing:
        raise SpecError(source, [f"missing {f}: none of {', '.join(ALIASES[f])} is set (model_type {model_type!r})"
                                 for f in missing])
    fields = {k: defaults[k] for k in ("norm", "bias", "position", "tied_embeddings") if k in defaults}
    fields |= {k: v for k, v in found.items() if v is not None and k != "activation"}
    fields["activation"] = _activation(config, defaults, source)
    if fields.get("position") != "rope":
        fields.pop("rope_theta", None)  # a base without rotary positions means nothing
    fields |= _bias_fields(_bias_parts(config, model_type, fields))
    hidden, heads = fields["hidden"], fields["heads"]
    sizes_ok = all(isinstance(v, int) and v > 0 for v in (hidden, heads))  # else validation names the field
    if sizes_ok and fields.get("head_dim") == hidden // heads:
        del fields["head_dim"]  # the default: keep the spec minimal
    fields |= moe_fields(config, model_type, fields["layers"], fields.get("ffn_hidden"), source)
    fields |= mla_fields(config, source)
    if "mla" in fields:
        fields.pop("head_dim", None)  # latent attention has its own head widths; head_dim would mean nothing
    fields |= detail_fields(config, model_type, fields.get("position") == "rope", "mla" in fields, source)
    return {"name": name, **fields, "source": f"Hugging Face config.json, model_type {printable(model_type)[:100]}"}


def _context_limit(config: dict, defaults: dict) -> tuple[int | None, str]:
    """The longest context the config states, and the field it came from."""
    for key in ALIASES["seq_len"]:
        if isinstance(config.get(key), int) and not isinstance(config[key], bool) and config[key] > 0:
            return config[key], key
    return defaults.get("seq_len"), "published training length"


def _check_context(config: dict, source: str) -> None:
    """A stated context of zero or fewer tokens is a broken config, not a missing field."""
    bad = [f"{key} {config[key]}: a model's context must be a positive number of tokens; fix the config"
           for key in ALIASES["seq_len"]
           if isinstance(config.get(key), int) and not isinstance(config[key], bool) and config[key] <= 0]
    if bad:
        raise SpecError(source, bad)


def _default_seq_len(config: dict, defaults: dict) -> int:
    """min(the stated context, DEFAULT_SEQ_LEN); DEFAULT_SEQ_LEN when the config states none."""
    limit, _ = _context_limit(config, defaults)
    return min(limit, DEFAULT_SEQ_LEN) if limit else DEFAULT_SEQ_LEN


def seq_len_note(config: dict, chosen: int) -> str:
    """How the import chose the training sequence length when --seq-len was not given."""
    config = _text_config(config)
    limit, key = _context_limit(config, FAMILIES.get(str(config.get("model_type"))) or {})
    if limit is None:
        why = "plan3d's default training length (the config states no context length)"
    elif limit > chosen:
        why = f"plan3d's default training length, not the config's {key} {limit:,} (the longest context it accepts)"
    else:
        why = f"the config's {key} (no longer than plan3d's {DEFAULT_SEQ_LEN:,} default)"
    return f"seq_len {chosen:,}: {why}; pass --seq-len N to plan another training length"


def _bias_parts(config: dict, model_type: str, fields: dict) -> dict[str, bool]:
    """Which linear layers carry a bias: q/k/v, the attention output, the MLP."""
    if model_type in QKV_BIAS_ONLY:
        return {"q/k/v": True, "attention output": False, "MLP": False}
    attention = config.get("attention_bias", fields.get("bias", True))
    return {"q/k/v": bool(attention), "attention output": bool(attention),
            "MLP": bool(config.get("mlp_bias", fields.get("bias", True)))}


def _bias_fields(parts: dict[str, bool]) -> dict[str, bool]:
    """`bias` for the output projection and the MLP together; `qkv_bias` only where it differs."""
    bias = parts["attention output"] and parts["MLP"]
    return {"bias": bias} | ({"qkv_bias": parts["q/k/v"]} if parts["q/k/v"] != bias else {})


def _represented(part: str, spec: ModelSpec) -> bool:
    return spec.qkv_bias_ if part == "q/k/v" else spec.bias


def bias_warning(config: dict, spec: ModelSpec) -> str | None:
    """Names the biases the spec's `bias` / `qkv_bias` leave out (an attention-output bias without
    an MLP one, or the reverse), with their count."""
    config = _text_config(config)
    model_type = str(config.get("model_type", "unknown"))
    parts = _bias_parts(config, model_type, FAMILIES.get(model_type) or _generic_hints(config))
    if all(_represented(p, spec) == has for p, has in parts.items()):
        return None
    mlp_mats = 3 if spec.activation == "swiglu" else 2
    per_layer = {"q/k/v": (spec.heads + 2 * spec.kv_heads_) * spec.head_dim_, "attention output": spec.hidden,
                 "MLP": (mlp_mats - 1) * spec.ffn_hidden_ + spec.hidden}
    dropped = [p for p, has in parts.items() if has and not _represented(p, spec)]
    count = spec.layers * sum(per_layer[p] for p in dropped)
    return (f"the model has {' and '.join(dropped)} biases but not on every linear layer; the model spec's "
            f"`bias` flag covers the attention output and the MLP together, so `bias: false` leaves out {count:,} parameters "
            f"({spec.layers} layers x {count // spec.layers:,})")


NAME_CHARS_MAX = 100


def default_name(path: Path, config: dict) -> str:
    """`_name_or_path` (its last part), else the folder holding config.json, else the model_type,
    made a safe spec name: only [a-z0-9._-] (every other run of characters becomes one '-'),
    starting and ending with a letter or digit; 'model' if nothing is left. A folder or config
    value is data, never a line of the spec file."""
    named = str(config.get("_name_or_path") or "").rstrip("/").split("/")[-1]
    folder = path.resolve().parent.name if path.name == "config.json" else path.stem
    for raw in (named, folder, str(config.get("model_type") or "")):
        safe = re.sub(r"[^a-z0-9._-]+", "-", raw.lower())[:NAME_CHARS_MAX].strip("._-")
        if safe:
            return safe
    return "model"


def read_hf(path_str: str, name: str | None = None, seq_len: int | None = None) -> HfImport:
    """Read a Hugging Face config.json (or the folder holding it) from disk: the spec and its notes."""
    path = Path(path_str)
    if path.is_dir() and (path / "config.json").is_file():  # a downloaded model folder
        path = path / "config.json"
    if not path.exists():
        raise SpecNotFound(f"{path_str}: no such file; give the path to a Hugging Face config.json "
                           "or to the model folder holding it")
    config = read_mapping(path)
    fields = spec_fields(config, path_str, name or default_name(path, config), seq_len)
    spec = validate(ModelSpec, fields, path_str)
    _check_learned_positions(config, spec, path_str)
    notes = [] if seq_len else [seq_len_note(config, spec.seq_len)]
    warnings = [w for w in (bias_warning(config, spec), dropout_warning(_text_config(config), path_str)) if w]
    return HfImport(spec, notes, warnings + unmodelled(_text_config(config), spec))


def _check_learned_positions(config: dict, spec: ModelSpec, source: str) -> None:
    """A learned position table has no rows past its length: a longer --seq-len cannot run."""
    limit, key = _context_limit(_text_config(config), {})
    if spec.position == "learned" and limit and spec.seq_len > limit:
        raise SpecError(source, [f"--seq-len {spec.seq_len} exceeds the config's {key} {limit}: learned positions "
                                 f"stop there; use --seq-len {limit} or less"])


def import_hf(path_str: str, name: str | None = None, seq_len: int | None = None) -> ModelSpec:
    """The ModelSpec a Hugging Face config.json on disk describes (notes dropped; see `read_hf`)."""
    return read_hf(path_str, name, seq_len).spec


def model_yaml(spec: ModelSpec, origin: str, remarks: list[str] = ()) -> str:
    """The spec as a YAML file a user can edit, with a header naming where it came from and `remarks`."""
    body = yaml.safe_dump(spec.model_dump(exclude_none=True), sort_keys=False)
    header = [f"# Imported by `plan3d import-hf` from {printable(origin)}; check it and cite the model card."]
    header += [f"# {printable(remark)}" for remark in remarks]  # escaped: a comment stays one line
    return "\n".join(header) + "\n" + body
