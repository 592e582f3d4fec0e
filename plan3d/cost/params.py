"""Parameter counts of a decoder-only transformer, per layer and per pipeline stage."""
from __future__ import annotations

from plan3d.specs.model import ModelSpec


def attention_params(model: ModelSpec) -> int:
    """Q and O projections h*(a*d), K and V h*(kv*d); 4h^2 without GQA (cost-model.md). Biases:
    on Q/K/V when `qkv_bias_` (Qwen2 has them alone), on the output projection when `bias`.
    Multi-head latent attention: `mla_params`."""
    if model.mla is not None:
        return mla_params(model)
    h, d = model.hidden, model.head_dim_
    q_out = model.heads * d
    kv_out = model.kv_heads_ * d
    weights = h * q_out + 2 * h * kv_out + q_out * h
    biases = (q_out + 2 * kv_out) * model.qkv_bias_ + h * model.bias
    return weights + biases


def mla_params(model: ModelSpec) -> int:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; HF
    DeepseekV3Attention): queries h -> q_lora (RMSNorm) -> heads*(nope+rope), or h ->
    heads*(nope+rope) without a query latent; keys/values h -> kv_lora + rope (the shared RoPE
    key), RMSNorm, kv_lora -> heads*(nope + v); output heads*v -> h. No biases."""
    mla, h, a = model.mla, model.hidden, model.heads
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        query = h * a * qk_head
    else:
        query = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * a * qk_head
    key_value = (h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
                 + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim))
    return query + key_value + a * mla.v_head_dim * h


def ffn_params(model: ModelSpec, width: int) -> int:
    """One feed-forward block of `width`: 2*h*f (GELU: up, down) or 3*h*f (SwiGLU: gate, up,
    down), plus biases when the model has them."""
    h = model.hidden
    mats = 3 if model.activation == "swiglu" else 2
    biases = ((mats - 1) * width + h) if model.bias else 0
    return mats * h * width + biases


def mlp_params(model: ModelSpec) -> int:
    """The dense MLP (`ffn_hidden`)."""
    return ffn_params(model, model.ffn_hidden_)


def expert_params(model: ModelSpec) -> int:
    """One routed expert: an FFN of `expert_ffn_hidden` (default the dense width)."""
    return ffn_params(model, model.moe.expert_ffn_hidden or model.ffn_hidden_)


def moe_shared_params(model: ModelSpec) -> int:
    """Parameters of an MoE layer every token uses and every expert-parallel rank replicates:
    the router (h x experts, + biases), the shared experts (one FFN of `shared_ffn_hidden`) and
    their gate (h -> 1, Qwen2-MoE)."""
    moe, h = model.moe, model.hidden
    router = h * moe.experts + (moe.experts if model.bias else 0)
    shared = ffn_params(model, moe.shared_ffn_hidden) if moe.shared_ffn_hidden else 0
    return router + shared + (h if moe.shared_expert_gate else 0)


def moe_mlp_params(model: ModelSpec) -> int:
    """The MLP of one MoE layer: every routed expert plus the shared part."""
    return model.moe.experts * expert_params(model) + moe_shared_params(model)


def norm_params(model: ModelSpec) -> int:
    """One norm of size h: weight (+ bias for LayerNorm)."""
    return model.hidden * (2 if model.norm == "layernorm" else 1)


def layer_params(model: ModelSpec, index: int = 0) -> int:
    """Transformer block `index`: attention, its MLP (dense, or every expert of an MoE layer) and two norms."""
    mlp = moe_mlp_params(model) if model.is_moe_layer(index) else mlp_params(model)
    return attention_params(model) + mlp + 2 * norm_params(model)


def active_layer_params(model: ModelSpec, index: int = 0) -> int:
    """Parameters of block `index` one token passes through: top_k routed experts, not all."""
    if not model.is_moe_layer(index):
        return layer_params(model, index)
    moe = model.moe
    return (attention_params(model) + moe.top_k * expert_params(model) + moe_shared_params(model)
            + 2 * norm_params(model))


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
    layers = sum(layer_params(model, i) for i in range(model.layers))
    return layers + embedding_params(model) + output_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters one token passes through (MoE: top_k routed experts per MoE layer), with the
    embedding and output layers counted whole, as Mistral, Qwen and Meta report theirs. DeepSeek
    and OpenAI leave the input embedding out of their active figures (V2-Lite 2.4B, gpt-oss-120b
    5.13B): subtract `embedding_params` to compare with those."""
    layers = sum(active_layer_params(model, i) for i in range(model.layers))
    return layers + embedding_params(model) + output_params(model)
