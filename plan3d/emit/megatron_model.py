"""Megatron-Core arguments that define the model (megatron-core 0.17 - 0.19): every field of the
model spec that changes what `pretrain_gpt.py` builds, so the job trains the model of the config.

Flag names are 0.19.2's own (megatron/training/arguments.py; TransformerConfig and
MLATransformerConfig in megatron/core/transformer/transformer_config.py):

- shapes: `--num-layers --hidden-size --num-attention-heads --ffn-hidden-size`, `--kv-channels`
  (a head dim other than hidden / heads), `--group-query-attention --num-query-groups` (GQA; not
  with MLA, validate_args excludes it);
- `--hidden-dropout` / `--attention-dropout` at the model's dropout (TransformerConfig defaults to
  0.1 for both; Llama, Mixtral, DeepSeek train without);
- `--normalization RMSNorm` and `--norm-epsilon` (TransformerConfig.layernorm_epsilon, default
  1e-5: Qwen2.5 and DeepSeek-V3 use 1e-6), `--qk-layernorm` (Qwen3's per-head q/k norms; with
  MLA the q and kv latent norms, DeepSeek's `q_a_layernorm` / `kv_a_layernorm`);
- `--swiglu`; `--disable-bias-linear`, `--add-qkv-bias` (Qwen2);
- positions: `--position-embedding-type learned_absolute | rope` with `--rotary-base`;
  Llama 3.1's scaling: `--use-rope-scaling --rope-scaling-factor F` (rotary_pos_embedding.py
  `_apply_scaling` fixes low/high frequency factors 1 and 4 and the original context 8192: the
  profile's `rope_scaling_fixed` refuses other values before planning); YaRN: with MLA
  `--rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim` (MLATransformerConfig keeps
  original context 4096 and betas 32/1 with no flag), without MLA `--position-embedding-type yarn`
  with the same three. MLA with plain RoPE adds `--no-rope-fusion`: MLATransformerConfig raises
  "apply_rope_fusion for MLA only works with YARN RoPE" with the fusion on, its default;
- `--untie-embeddings-and-output-weights`;
- vocabulary: Megatron pads it to a multiple of `--make-vocab-size-divisible-by` x tp (default
  128 x tp; `calculate_padded_vocab_size`). The emitter passes the largest power of two up to 128
  that keeps the model's own vocabulary (a padded vocabulary is another model: more embedding and
  output rows, another logit width); when tp does not divide the vocabulary it passes 1, which pads
  to a multiple of tp as plan3d's memory model does, and a note says so.

What the MoE and MLA layers take is plan3d/emit/megatron_moe.py. What no flag expresses was
refused before this module runs (the profile's `can_run.models`, read by `target_engine`).
"""
from __future__ import annotations

from plan3d.errors import InfeasibleError
from plan3d.plan import Plan
from plan3d.specs.model import ModelSpec

ROTARY_BASE_DEFAULT = 10000  # megatron/training/arguments.py --rotary-base default
VOCAB_ALIGNMENT_MAX = 128  # --make-vocab-size-divisible-by default


def model_args(plan: Plan) -> list[str]:
    """The dense model's flags: shapes, dropout, norms, MLP, biases, positions, embeddings, vocabulary."""
    model = plan.model
    return (_shape_args(model) + _dropout_args(model) + _norm_args(model) + _mlp_bias_args(model)
            + position_args(model) + _embedding_args(model, plan.layout.tp))


def _shape_args(model: ModelSpec) -> list[str]:
    args = ["--num-layers", str(model.layers), "--hidden-size", str(model.hidden),
            "--num-attention-heads", str(model.heads), "--ffn-hidden-size", str(model.ffn_hidden_),
            "--vocab-size", str(model.vocab)]
    if model.head_dim is not None and model.mla is None:  # MLA: --qk-head-dim / --v-head-dim instead
        args += ["--kv-channels", str(model.head_dim)]
    if model.kv_heads_ != model.heads and model.mla is None:  # validate_args: GQA excludes MLA
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads_)]
    return args


def _dropout_args(model: ModelSpec) -> list[str]:
    """The model's dropout (TransformerConfig defaults to 0.1 for both), which the memory budgets."""
    rate = repr(float(model.dropout))
    return ["--hidden-dropout", rate, "--attention-dropout", rate]


def _norm_args(model: ModelSpec) -> list[str]:
    args = ["--normalization", "RMSNorm"] if model.norm == "rmsnorm" else []
    args += ["--norm-epsilon", repr(float(model.norm_eps_))]
    return args + (["--qk-layernorm"] if model.qk_norm else [])


def _mlp_bias_args(model: ModelSpec) -> list[str]:
    args = ["--swiglu"] if model.activation == "swiglu" else []
    if not model.bias:
        args.append("--disable-bias-linear")
        if model.qkv_bias_:
            args.append("--add-qkv-bias")  # Megatron's flag for Qwen2-style Q/K/V biases
    return args


def position_args(model: ModelSpec) -> list[str]:
    """Position encoding, RoPE base and scaling, as the model's attention (MLA or not) takes them."""
    if model.position != "rope":
        return ["--position-embedding-type", "learned_absolute"]
    scaling = model.rope_scaling
    kind = "yarn" if scaling is not None and scaling.type == "yarn" and model.mla is None else "rope"
    args = ["--position-embedding-type", kind, "--rotary-base", rotary_base(model.rope_theta)]
    if scaling is not None and scaling.type == "llama3":
        args += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(scaling.factor))]
    elif scaling is not None:  # yarn: the MLA config's or the GPT model's YaRN (same three flags)
        args += ["--rotary-scaling-factor", repr(float(scaling.factor)), "--mscale", repr(float(scaling.value("mscale"))),
                 "--mscale-all-dim", repr(float(scaling.value("mscale_all_dim")))]
    if model.mla is not None:
        yarn = scaling is not None and scaling.type == "yarn"
        args += ["--rope-type", "yarn" if yarn else "rope"] + ([] if yarn else ["--no-rope-fusion"])
    return args


def rotary_base(theta: float | None) -> str:
    if theta is None:
        return str(ROTARY_BASE_DEFAULT)
    if theta != int(theta):
        raise InfeasibleError(f"megatron-core takes an integer --rotary-base; the model spec's rope_theta is {theta}")
    return str(int(theta))


def _embedding_args(model: ModelSpec, tp: int) -> list[str]:
    args = [] if model.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    return args + ["--make-vocab-size-divisible-by", str(vocab_alignment(model.vocab, tp))]


def vocab_alignment(vocab: int, tp: int) -> int:
    """The largest power of two d <= 128 with d x tp dividing the vocabulary (Megatron pads to a
    multiple of d x tp); 1 when tp does not divide it (padded to a multiple of tp)."""
    d = VOCAB_ALIGNMENT_MAX
    while d > 1 and vocab % (d * tp):
        d //= 2
    return d


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary Megatron builds with `vocab_alignment` (`calculate_padded_vocab_size`)."""
    multiple = vocab_alignment(vocab, tp) * tp
    return -(-vocab // multiple) * multiple


def vocab_notes(plan: Plan) -> list[str]:
    """A padded vocabulary, said once (the plan's memory model pads it the same way)."""
    vocab, tp = plan.model.vocab, plan.layout.tp
    padded = padded_vocab(vocab, tp)
    if padded == vocab:
        return []
    return [f"tp={tp} does not divide the vocabulary {vocab}: Megatron pads it to {padded} rows "
            f"({padded - vocab} unused tokens, counted by the plan's memory)"]
