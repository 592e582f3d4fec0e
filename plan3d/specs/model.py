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
    load_factor: float | None = Field(None, ge=1, le=1000, allow_inf_nan=False,
                                      description="Tokens the busiest expert-parallel rank computes, as a multiple "
                                      "of its even share (every rank waits for it at the combine), for dropless "
                                      "routing (a capacity_factor pads every expert to it instead); None: plan3d's "
                                      "prior 1.1; 1.0 under forced "
                                      "balance (Megatron-Core --moe-router-force-load-balancing, a benchmarking "
                                      "setting), or an imbalance measured on the user's own router.")
    normalize_top_k: bool = Field(True, description="The top-k routing weights are renormalised to sum to 1 "
                                  "(Hugging Face `norm_topk_prob`; Mixtral, DeepSeek-V3: yes; Qwen2-MoE, "
                                  "DeepSeek-V2: no, Megatron `--moe-router-pre-softmax`).")
    top_k_scaling: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False,
                                        description="The routing weights are multiplied by this (DeepSeek "
                                        "`routed_scaling_factor`, Megatron `--moe-router-topk-scaling-factor`); "
                                        "None: 1.")
    router_groups: PositiveInt | None = Field(None, le=1_000_000, description="Group-limited routing: the "
                                              "experts form this many groups (DeepSeek `n_group`, Megatron "
                                              "`--moe-router-num-groups`); None: no groups.")
    router_group_top_k: PositiveInt | None = Field(None, le=1_000_000, description="A token routes only into "
                                                   "its best this-many groups (DeepSeek `topk_group`, Megatron "
                                                   "`--moe-router-group-topk`).")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if (self.router_groups is None) != (self.router_group_top_k is None):
            raise ValueError("router_groups and router_group_top_k go together (group-limited routing): set both "
                             "or neither")
        if self.router_groups is not None:
            if self.experts % self.router_groups:
                raise ValueError(f"router_groups={self.router_groups} does not divide experts={self.experts}")
            if self.router_group_top_k > self.router_groups:
                raise ValueError(f"router_group_top_k={self.router_group_top_k} exceeds "
                                 f"router_groups={self.router_groups}")
        return self

    @property
    def group_limited(self) -> bool:
        """Tokens route within their best groups only (router_groups > 1)."""
        return self.router_groups is not None and self.router_groups > 1


class MLASpec(SpecModel):
    """Multi-head latent attention (DeepSeek-V2/V3; Megatron-Core `--multi-latent-attention`):
    queries (optionally) and keys/values pass through low-rank latents; each head's query/key
    has a no-position part and a RoPE part, and its value its own width."""

    q_lora_rank: PositiveInt | None = Field(None, le=10_000_000, description="None: a full-rank query projection.")
    kv_lora_rank: PositiveInt = Field(le=10_000_000)
    qk_nope_head_dim: PositiveInt = Field(le=100_000)
    qk_rope_head_dim: PositiveInt = Field(le=100_000)
    v_head_dim: PositiveInt = Field(le=100_000)


ROPE_SCALING_DEFAULTS = {  # Hugging Face modeling_rope_utils defaults, used when a config leaves one out
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192},
    "yarn": {"original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
             "mscale_all_dim": 0.0},
}


class RopeScaling(SpecModel):
    """RoPE frequency scaling (Hugging Face `rope_scaling`): Llama 3.1's `llama3` (low frequencies
    divided by `factor`, a smooth ramp between `low_freq_factor` and `high_freq_factor` wavelengths
    of the original context) or YaRN (Peng et al. 2023, arXiv 2309.00071: ramp between `beta_slow`
    and `beta_fast` rotations, attention scaled by `mscale`; DeepSeek-V2/V3). Fields that do not
    belong to the type stay unset; unset fields take ROPE_SCALING_DEFAULTS."""

    type: Literal["llama3", "yarn"]
    factor: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    original_max_position: PositiveInt | None = Field(None, le=1_000_000_000)
    low_freq_factor: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    high_freq_factor: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    beta_fast: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    beta_slow: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    mscale: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)
    mscale_all_dim: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "RopeScaling":
        own = ROPE_SCALING_DEFAULTS[self.type]
        stray = [name for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                                   "mscale_all_dim") if getattr(self, name) is not None and name not in own]
        if stray:
            raise ValueError(f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} not a field of "
                             f"{self.type} scaling (it has factor, {', '.join(own)})")
        return self

    def value(self, name: str) -> float:
        """A parameter of this scaling, its default when unset."""
        given = getattr(self, name)
        return ROPE_SCALING_DEFAULTS[self.type][name] if given is None else given

    def parameters(self) -> dict[str, float]:
        """Every parameter of its type, defaults filled in (factor first)."""
        return {"factor": self.factor} | {name: self.value(name) for name in ROPE_SCALING_DEFAULTS[self.type]}


NORM_EPS_DEFAULT = 1e-5  # Megatron-Core TransformerConfig.layernorm_epsilon, HF LlamaConfig.rms_norm_eps


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
    norm_eps: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False,
                                   description="The norms' epsilon (HF `rms_norm_eps` / `layer_norm_epsilon`, "
                                   "Megatron `--norm-epsilon`); default 1e-5. Qwen2.5, DeepSeek-V3: 1e-6.")
    qk_norm: bool = Field(False, description="RMSNorm on each head's query and key (Qwen3, OLMo 2; Megatron "
                          "`--qk-layernorm`); with MLA, on the query and key/value latents (DeepSeek-V2/V3 "
                          "`q_a_layernorm`, `kv_a_layernorm`).")
    bias: bool = Field(True, description="Linear layers carry biases (GPT-2/3: yes, Llama: no).")
    qkv_bias: bool | None = Field(None, description="The Q/K/V projections carry biases; default = bias "
                                  "(Qwen2: qkv_bias true with bias false).")
    position: Literal["learned", "rope", "alibi"] = "learned"
    rope_theta: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False,
                                     description="RoPE base (Hugging Face `rope_theta`, Megatron `--rotary-base`); "
                                     "default 10000 (Megatron-Core's default). Llama 3: 500000.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (Llama 3.1: llama3 "
                                             "factor 8; DeepSeek-V3: yarn factor 40); None: plain RoPE.")
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
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(f"rope_scaling needs position rope (the model has {self.position}); remove it")
        return self

    @property
    def norm_eps_(self) -> float:
        return NORM_EPS_DEFAULT if self.norm_eps is None else self.norm_eps

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
