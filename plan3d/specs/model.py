"""Model spec: a decoder-only transformer described by its shapes."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from plan3d.specs.base import Name, SpecModel, Text


class MoESpec(SpecModel):
    """Mixture-of-experts MLP (every `every`-th layer). The planner treats it as dense for now."""

    experts: PositiveInt = Field(le=1_000_000)
    top_k: PositiveInt = Field(2, le=1_000_000)
    expert_ffn_hidden: PositiveInt | None = Field(None, le=100_000_000)
    every: PositiveInt = Field(1, le=100_000)

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        return self


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
    moe: MoESpec | None = None
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
