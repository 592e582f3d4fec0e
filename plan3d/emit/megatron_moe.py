"""Megatron-Core arguments for mixture-of-experts layers and multi-latent attention (megatron-core 0.19).

Names and checks are 0.19.2's own (megatron/training/arguments.py `_add_moe_args`, `_add_mla_args`,
`validate_args`; megatron/core/transformer/transformer_config.py `TransformerConfig`,
`MLATransformerConfig`; megatron/core/transformer/moe/moe_layer.py; megatron/core/parallel_state.py
`initialize_model_parallel`), and the engines tier feeds them to that code
(tests/engines/test_moe_engines.py; it passes unchanged against 0.17.0 and 0.18.0 unpacked wheels
with PLAN3D_MEGATRON_DIR).

What a plan's MoE spec becomes:
- `--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size` (the routed expert's width);
- `--moe-layer-freq`: the integer N when the MoE layers are every N-th from layer 0 (Megatron's
  `i % N == 0`, gpt_layer_specs.py, is plan3d's rule), otherwise the explicit 0/1 list as the
  Python expression Megatron evaluates (`([0]*3+[1]*58)`: three dense layers, then 58 MoE);
- shared experts: `--moe-shared-expert-intermediate-size` (their total width),
  `--moe-shared-expert-gate` (Qwen2-MoE's sigmoid gate) and `--moe-shared-expert-overlap` (the
  shared experts run while the all-to-all dispatch is in flight; TransformerConfig allows it with
  the alltoall and flex dispatchers, the two this emitter writes);
- router: softmax -> `--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2` (the
  GShard / Switch Transformer balance loss at the starting value Megatron's help text recommends);
  sigmoid -> `--moe-router-score-function sigmoid --moe-router-enable-expert-bias` (DeepSeek-V3's
  auxiliary-loss-free balancing, Wang et al. 2024, arXiv 2408.15664) with the complementary
  sequence-wise loss `seq_aux_loss` at 1e-4 (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 2.1.2);
- capacity factor: `--moe-expert-capacity-factor F --moe-token-drop-policy probs
  --moe-pad-expert-input-to-capacity` (every expert computes exactly its capacity; TransformerConfig
  needs a capacity factor for the padding and an aux-loss balancing type for the factor); none: dropless;
- `--moe-grouped-gemm` (validate_args asserts compute capability >= 8; left off before Ampere, with a
  note) and the dispatcher the plan was predicted with: `--moe-token-dispatcher-type alltoall`, or
  `flex` with `--moe-flex-dispatcher-backend deepep | hybridep` (`--ep-dispatcher`);
- `--expert-tensor-parallel-size`: the layout's etp (MoE Parallel Folding), by default tp, each expert
  split like the dense MLP.

- the routing weights: `--moe-router-pre-softmax` for a softmax router whose top-k weights are not
  renormalised (Qwen2-MoE, DeepSeek-V2 `norm_topk_prob: false`; without it Megatron takes the
  softmax over the top-k logits, which sums to 1), `--moe-router-topk-scaling-factor` (DeepSeek
  `routed_scaling_factor`), `--moe-router-num-groups --moe-router-group-topk` (group-limited
  routing, DeepSeek `n_group` / `topk_group`); a sigmoid router is always renormalised
  (moe_utils.py), so the profile refuses one that is not.

MLA: `--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim (no-position part)
--qk-pos-emb-head-dim (RoPE part) --v-head-dim`; its RoPE type (`--rope-type`, MLATransformerConfig
defaults to YaRN with scaling factor 40) follows the model spec's rope_scaling
(plan3d/emit/megatron_model.py). No `--group-query-attention` / `--kv-channels` with MLA
(validate_args: mutually exclusive).
"""
from __future__ import annotations

from plan3d.plan import Plan
from plan3d.specs.model import ModelSpec

SOFTMAX_AUX_LOSS = ("aux_loss", "1e-2")
SIGMOID_SEQ_AUX_LOSS = ("seq_aux_loss", "1e-4")
GROUPED_GEMM_MIN_ARCH = 8  # validate_args: torch.cuda.get_device_capability()[0] >= 8


def moe_layer_freq(model: ModelSpec) -> str:
    """`--moe-layer-freq`: N when the MoE layers are exactly every N-th from layer 0, else Megatron's
    list expression of 0 (dense) / 1 (MoE) per layer, run-length encoded."""
    every = model.moe.every
    flags = [int(model.is_moe_layer(i)) for i in range(model.layers)]
    if flags == [int(i % every == 0) for i in range(model.layers)]:  # gpt_layer_specs.py's integer rule
        return str(every)
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append(f"[{flags[start]}]*{i - start}")
            start = i
    return "(" + "+".join(runs) + ")"


def moe_problems(plan: Plan) -> list[str]:
    """What Megatron-Core 0.19 refuses for this plan's experts, each with the code that refuses it
    (the dispatcher's own rule is the engine profile's: `EngineSpec.model_problems`)."""
    model, layout, out = plan.model, plan.layout, []
    moe = model.moe
    if moe is None:
        if layout.ep > 1:
            out.append("expert parallelism needs a MoE model (validate_args: num_experts must be set with ep > 1); "
                       "set ep=1 or give the model spec a moe")
        return out
    if moe.experts % layout.ep:
        out.append(f"ep={layout.ep} does not divide the {moe.experts} experts (validate_args: 'Number of experts "
                   "should be a multiple of expert model parallel_size'); use an ep that divides them")
    if layout.tp > 1 and not layout.sequence_parallel:
        out.append("MoE layers with tp > 1 train only with sequence parallelism (MoELayer.forward raises "
                   "without it); set sequence_parallel")
    if layout.expert_tp > 1 and model.bias:
        out.append(f"MoE experts with biases need expert tensor parallel size 1 (TransformerConfig: 'Bias in Moe "
                   f"is only supported when ETP==1'), and the plan splits experts over {layout.expert_tp} ranks; "
                   "set etp=1 or use a model without biases")
    if layout.order.endswith("dp") and layout.pp > 1 and layout.expert_dp != layout.dp:
        out.append(f"rank order tp-cp-ep-pp-dp with pp > 1 needs the MoE layers' data-parallel size "
                   f"{layout.expert_dp} to equal dp={layout.dp} "
                   "(initialize_model_parallel asserts it); use the default order tp-cp-ep-dp-pp")
    return out


def dispatcher_args(dispatcher: str) -> list[str]:
    """The token dispatcher the plan was predicted with (RunsAs.ep_dispatcher): alltoall, or the
    flex dispatcher with the DeepEP / HybridEP backend (TransformerConfig.moe_token_dispatcher_type,
    moe_flex_dispatcher_backend)."""
    if dispatcher == "alltoall":
        return ["--moe-token-dispatcher-type", "alltoall"]
    return ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", dispatcher]


def moe_args(plan: Plan, gpu_arch: int, dispatcher: str = "alltoall", combined: bool = False) -> list[str]:
    """The MoE flags of a MoE model (none for a dense one); `moe_problems` says what is refused.
    `combined`: the all-to-alls hidden by the combined 1F1B schedule
    (`--overlap-moe-expert-parallel-comm`, ep > 1), which TransformerConfig runs without the
    shared-expert overlap."""
    moe = plan.model.moe
    if moe is None:
        return []
    args = ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn_hidden or plan.model.ffn_hidden_),
            "--moe-layer-freq", moe_layer_freq(plan.model), *dispatcher_args(dispatcher),
            "--expert-tensor-parallel-size", str(plan.layout.expert_tp)]
    if gpu_arch >= GROUPED_GEMM_MIN_ARCH:
        args.append("--moe-grouped-gemm")
    combined = combined and plan.layout.ep > 1
    if combined:
        args.append("--overlap-moe-expert-parallel-comm")
    return (args + _shared_expert_args(plan.model, not combined) + _router_args(plan.model)
            + _capacity_args(plan.model))


def _shared_expert_args(model: ModelSpec, overlap: bool = True) -> list[str]:
    moe = model.moe
    if moe.shared_ffn_hidden == 0:
        return []
    args = ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn_hidden)]
    args += ["--moe-shared-expert-overlap"] if overlap else []
    if moe.shared_expert_gate:
        args.append("--moe-shared-expert-gate")
    return args


def _router_args(model: ModelSpec) -> list[str]:
    moe = model.moe
    if moe.router == "sigmoid":
        balance, coeff = SIGMOID_SEQ_AUX_LOSS
        args = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    else:
        balance, coeff = SOFTMAX_AUX_LOSS
        args = [] if moe.normalize_top_k or moe.top_k == 1 else ["--moe-router-pre-softmax"]
    args += ["--moe-router-load-balancing-type", balance, "--moe-aux-loss-coeff", coeff]
    if moe.top_k_scaling not in (None, 1):
        args += ["--moe-router-topk-scaling-factor", repr(float(moe.top_k_scaling))]
    if moe.group_limited:
        args += ["--moe-router-num-groups", str(moe.router_groups), "--moe-router-group-topk",
                 str(moe.router_group_top_k)]
    return args


def _capacity_args(model: ModelSpec) -> list[str]:
    factor = model.moe.capacity_factor
    if factor is None:
        return []
    return ["--moe-expert-capacity-factor", repr(float(factor)), "--moe-token-drop-policy", "probs",
            "--moe-pad-expert-input-to-capacity"]


def mla_problems(model: ModelSpec) -> list[str]:
    """Megatron's MLA rotates the RoPE part of each query/key head: it needs position rope."""
    if model.mla is not None and model.position != "rope":
        return [f"its multi-latent attention applies RoPE to the qk_pos_emb part; {model.name} has position "
                f"{model.position}: set position rope"]
    return []


def mla_args(model: ModelSpec) -> list[str]:
    """Multi-latent attention flags (none without MLA)."""
    mla = model.mla
    if mla is None:
        return []
    args = ["--multi-latent-attention"]
    if mla.q_lora_rank is not None:
        args += ["--q-lora-rank", str(mla.q_lora_rank)]
    return args + ["--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
                   "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--v-head-dim", str(mla.v_head_dim)]


def moe_notes(plan: Plan, gpu_arch: int) -> list[str]:
    """What the MoE flags leave to the user or cannot give this plan."""
    moe, notes = plan.model.moe, []
    if moe is None:
        return notes
    if gpu_arch < GROUPED_GEMM_MIN_ARCH:
        notes.append(f"--moe-grouped-gemm is off: validate_args needs compute capability >= 8 and "
                     f"{plan.cluster.gpu.name} is older or unknown; the experts run one GEMM each (slower)")
    balance, coeff = SIGMOID_SEQ_AUX_LOSS if moe.router == "sigmoid" else SOFTMAX_AUX_LOSS
    notes.append(f"router load balancing {balance} at --moe-aux-loss-coeff {coeff} is a training choice, "
                 "not part of the plan: change it in the arguments if your recipe differs")
    return notes
