"""Model spec: a decoder-only transformer described by its shapes."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from plan3d.specs.base import Name, SpecModel, Text


class MoESpec(SpecModel):
    """Mixture-of-experts MLP: which layers route, to how many experts, of what size.

    Layer i (0-based) is an MoE layer when i >= `first_dense_layers` and i % `every` == 0
    (Megatron-Core `--moe-layer-freq N`; DeepSeek-V3 `first_k_dense_replace`, `moe_layer_freq`).
    The other layers keep the model's dense MLP (`ffn_hidden`)."""

    experts: PositiveInt = Field(le=1_000_000, description="Routed experts per MoE layer.")
    top_k: PositiveInt = Field(2, le=1_000_000, description="Routed experts each token goes to.")
    expert_ffn_hidden: PositiveInt | None = Field(None, le=100_000_000,
                                                  description="FFN width of one routed expert; default ffn_hidden.")
    shared_ffn_hidden: int = Field(0, ge=0, le=100_000_000,
                                   description="Total FFN width of the shared experts every token goes "
                                   "through (DeepSeek: n_shared_experts x moe_intermediate_size; Megatron "
                                   "--moe-shared-expert-intermediate-size); 0: none.")
    shared_expert_gate: bool = Field(False, description="A sigmoid gate h -> 1 scales the shared experts (Qwen2-MoE).")
    every: PositiveInt = Field(1, le=100_000, description="One MoE layer every `every` layers.")
    first_dense_layers: int = Field(0, ge=0, le=100_000, description="The first k layers stay dense.")
    router: Literal["softmax", "sigmoid"] = Field("softmax", description="Router score function "
                                                  "(DeepSeek-V3: sigmoid with an expert bias).")
    capacity_factor: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False,
                                          description="Tokens an expert takes, as a multiple of its even share; "
                                          "None: dropless (every routed token is computed).")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        return self


class MLASpec(SpecModel):
    """Multi-head latent attention (DeepSeek-V2/V3; Megatron-Core `--multi-latent-attention`):
    queries (optionally) and keys/values pass through low-rank latents; each head's query/key
    has a no-position part and a RoPE part, and its value its own width."""

    q_lora_rank: PositiveInt | None = Field(None, le=10_000_000, description="None: a full-rank query projection.")
    kv_lora_rank: PositiveInt = Field(le=10_000_000)
    qk_nope_head_dim: PositiveInt = Field(le=100_000)
    qk_rope_head_dim: PositiveInt = Field(le=100_000)
    v_head_dim: PositiveInt = Field(le=100_000)


class ModelSpec(SpecModel):
    name: Name
    layers: PositiveInt = Field(le=100_000)  # the bounds stop typos (1e30) long before real models
    hidden: PositiveInt = Field(le=10_000_000)
    heads: PositiveInt = Field(le=1_000_000)
    kv_heads: PositiveInt | None = Field(None, le=1_000_000, description="Key/value heads (GQA); default = heads.")
    head_dim: PositiveInt | None = Field(None, le=1_000_000, description="Default hidden / heads.")
    ffn_hidden: PositiveInt | None = Field(None, le=100_000_000,
                                           description="Default 4*hidden (gelu), 8/3*hidden (swiglu).")
    activation: Literal["gelu", "relu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = Field(True, description="Linear layers carry biases (GPT-2/3: yes, Llama: no).")
    qkv_bias: bool | None = Field(None, description="The Q/K/V projections carry biases; default = bias "
                                  "(Qwen2: qkv_bias true with bias false).")
    position: Literal["learned", "rope", "alibi"] = "learned"
    rope_theta: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False,
                                     description="RoPE base (Hugging Face `rope_theta`, Megatron `--rotary-base`); "
                                     "default 10000 (Megatron-Core's default). Llama 3: 500000.")
    vocab: PositiveInt = Field(le=1_000_000_000)
    seq_len: PositiveInt = Field(le=1_000_000_000)
    tied_embeddings: bool = False
    dropout: float = Field(0.0, ge=0, lt=1, description="Hidden and attention dropout probability it trains "
                           "with: each dropout keeps a 1-byte mask per element for the backward (Korthikanti et al. "
                           "2022, Sec. 4.1). 0: none (Llama, Mixtral, DeepSeek); Megatron's default is 0.1 "
                           "(GPT-3, BLOOM, OPT).")
    moe: MoESpec | None = None
    mla: MLASpec | None = Field(None, description="Multi-head latent attention replaces heads x head_dim "
                                "Q/K/V projections (kv_heads and head_dim are then unused).")
    default_global_batch: PositiveInt | None = Field(
        None, le=1_000_000_000, description="Global batch (sequences) it was trained with; used when none is given."
    )
    source: Text = ""

    @model_validator(mode="after")
    def _shapes_agree(self) -> "ModelSpec":
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; set head_dim")
        return self

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) routes to experts (MoESpec's rule)."""
        moe = self.moe
        return moe is not None and index >= moe.first_dense_layers and index % moe.every == 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    @property
    def qkv_bias_(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def kv_heads_(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def ffn_hidden_(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation == "swiglu":
            return int(8 * self.hidden / 3)
        return 4 * self.hidden
