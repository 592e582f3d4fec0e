"""Parameter counts of a decoder-only transformer, per layer and per pipeline stage."""
from __future__ import annotations

from plan3d.specs.model import ModelSpec


def attention_params(model: ModelSpec) -> int:
    """Q and O projections h*(a*d), K and V h*(kv*d); 4h^2 without GQA (cost-model.md). Biases:
    on Q/K/V when `qkv_bias_` (Qwen2 has them alone), on the output projection when `bias`."""
    h, d = model.hidden, model.head_dim_
    q_out = model.heads * d
    kv_out = model.kv_heads_ * d
    weights = h * q_out + 2 * h * kv_out + q_out * h
    biases = (q_out + 2 * kv_out) * model.qkv_bias_ + h * model.bias
    return weights + biases


def mlp_params(model: ModelSpec) -> int:
    """2*h*ffn (GELU: up, down) or 3*h*ffn (SwiGLU: gate, up, down), plus biases."""
    h, f = model.hidden, model.ffn_hidden_
    mats = 3 if model.activation == "swiglu" else 2
    biases = ((mats - 1) * f + h) if model.bias else 0
    return mats * h * f + biases


def norm_params(model: ModelSpec) -> int:
    """One norm of size h: weight (+ bias for LayerNorm)."""
    return model.hidden * (2 if model.norm == "layernorm" else 1)


def layer_params(model: ModelSpec) -> int:
    """One transformer block: attention, MLP and two norms. (MoE counted as dense, see MoESpec.)"""
    return attention_params(model) + mlp_params(model) + 2 * norm_params(model)


def embedding_params(model: ModelSpec) -> int:
    """Input token embedding V*h, plus learned positions s*h."""
    positions = model.seq_len * model.hidden if model.position == "learned" else 0
    return model.vocab * model.hidden + positions


def output_params(model: ModelSpec) -> int:
    """Final norm plus the output projection h*V (zero extra when tied and on one stage)."""
    head = 0 if model.tied_embeddings else model.vocab * model.hidden
    return norm_params(model) + head


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model, counted once (tied embeddings once)."""
    return model.layers * layer_params(model) + embedding_params(model) + output_params(model)
