"""Engine spec: what a training engine can run, and how it runs it.

A prediction is always of some engine running a layout. The same (tp, pp, dp, ZeRO) layout is a
different job under Megatron-Core (flash attention, overlapped gradient reduction), Megatron-LM of
2020-2022 (attention scores written to HBM, gradients reduced after the backward) or DeepSpeed
ZeRO-3 (parameter gathers per micro-batch). An engine profile says

- `can_run`: the layouts the engine accepts (ZeRO stages with and without pipeline parallelism,
  sequence parallelism, interleaving, recompute granularities, rank orders, uneven pipeline
  splits). The search only proposes what the chosen engine can run; `estimate` refuses the rest
  with a sentence naming the engine.
- `runs_as`: how it runs it, as physics the cost model reads (attention kernel, what is
  overlapped with compute, how ZeRO-3 collectives use the network).
- `efficiency`: values of the engine's software fitted on measured runs (non-GEMM bytes, host
  overheads); a value left empty falls back to the GPU spec's `compute_efficiency`, so a cluster
  calibrated with `plan3d calibrate` keeps its measured values under an engine that sets none.
"""
from __future__ import annotations

import math
from typing import Literal, get_args

import numpy as np

from pydantic import Field, field_validator, model_validator

from plan3d.errors import LayoutError
from plan3d.specs.base import BYTES_PER_ELEMENT, EFFICIENCY, FRACTION, OVERHEAD_S, Name, SpecModel, Text, bounded
from plan3d.specs.model import ModelSpec
from plan3d.specs.order import DEFAULT_ORDER, LayoutShape, parse_order
from plan3d.specs.schedule import code_of, schedule_names, schedules
from plan3d.specs.schedule import zero_bubble as is_zero_bubble
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_MODES


def split_text(split: tuple[int, ...]) -> str:
    """A split as people write it: 7, 8 x 14, 7."""
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ", ".join(f"{n} x {k}" if k > 1 else str(n) for n, k in runs)


def balanced_split(layers: int, chunks: int) -> tuple[int, ...]:
    """Layers per virtual stage when chunks does not divide layers: the extra layers go to the
    middle stages first, so the first (embedding) and last (logits) stages stay lighter, as in
    Llama 3 405B's 126 layers on 16 stages (7, 8 x 14, 7; Dubey et al. 2024, section 3.3)."""
    base, extra = divmod(layers, chunks)
    order = list(range(1, chunks - 1)) + [0, chunks - 1]
    split = [base] * chunks
    for stage in order[:extra]:
        split[stage] += 1
    return tuple(split)

Recompute = Literal[RECOMPUTE_MODES]
CpComm = Literal["p2p", "all_gather", "a2a"]
CP_COMM_HELP = ("p2p: K/V chunks passed round a ring, each transfer overlapped with one block of attention; "
                "all_gather: the whole sequence's K/V gathered before attention (blocking), dK/dV reduce-scattered "
                "after it; a2a: Ulysses-style all-to-alls of Q, K, V and the output that trade the sequence split "
                "for a head split (heads / tp and kv_heads / tp must divide by cp)")
EpDispatcher = Literal["alltoall", "deepep", "hybridep"]
HIERARCHICAL_DISPATCHERS = ("deepep", "hybridep")  # one copy of a token per node it reaches (plan3d.cost.moe)
EP_DISPATCHER_HELP = ("alltoall: every routed token copy sent to its expert's rank (NCCL all-to-all, Megatron-Core "
                      "--moe-token-dispatcher-type alltoall); deepep: DeepEP's hierarchical kernels, each token sent "
                      "once to every other node holding one of its experts (RDMA) and forwarded to those experts' "
                      "GPUs over NVLink (Megatron-Core --moe-token-dispatcher-type flex "
                      "--moe-flex-dispatcher-backend deepep); hybridep: NVIDIA's HybridEP, the same hierarchy over "
                      "an NVLink domain of many GPUs (GB200 NVL72; --moe-flex-dispatcher-backend hybridep)")
EpOverlap = Literal["none", "combined-1f1b"]
EP_OVERLAP_HELP = ("none: the all-to-alls run exposed; combined-1f1b: each steady-state step runs one micro-batch's "
                   "forward and another's backward interleaved, so each one's all-to-alls hide behind the other's "
                   "computation (Megatron-Core --overlap-moe-expert-parallel-comm: pipeline_parallel/combined_1f1b.py)")
ActOffload = Literal["none", "experts", "all"]
# the modules whose saved tensors each choice moves to host memory (Megatron-Core 0.19
# --fine-grained-activation-offloading --offload-modules ...: TransformerConfig.offload_modules);
# attn_norm and mlp_norm are left out: with Transformer Engine the norms before QKV and the dense
# MLP are fused into LayerNormLinear / LayerNormMLP (IdentityOp modules that offload nothing)
EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act")
ACT_OFFLOAD_MODULES = {"none": (), "experts": EXPERT_OFFLOAD_MODULES,
                       "all": ("qkv_linear", "core_attn", "attn_proj", *EXPERT_OFFLOAD_MODULES)}
ACT_OFFLOAD_HELP = ("none: activations stay on the GPU; experts: the routed experts' FC1 input and activation input "
                    "go to host memory in the forward and come back before the backward (Megatron-Core "
                    "--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act), MoE models; all: "
                    "also the attention's QKV, core-attention and projection inputs (--offload-modules qkv_linear "
                    "core_attn attn_proj expert_fc1 moe_act)")
# the recompute modes an expert-module offload cannot run with (TransformerConfig.__post_init__:
# "Cannot offload moe_act/expert_fc1 while recomputing the entire MoE layer")
OFFLOAD_REFUSED_RECOMPUTE = ("moe",)
# combined-1f1b as Megatron-Core 0.19 runs it (TransformerConfig.__post_init__): ep > 1, a virtual
# pipeline with pp > 1, none of these recompute modes, one more warm-up micro-batch (schedules.py)
COMBINED_1F1B_REFUSED_RECOMPUTE = ("full", "partial", "moe")
UnevenSplit = Literal["none", "explicit", "embedding-as-layer"]
SOFTWARE_KEYS = ("elementwise_bytes", "attention_score_bytes", "layer_overhead_s", "micro_batch_overhead_s",
                 "dp_overlap_fraction")


ACTIVATIONS = get_args(ModelSpec.model_fields["activation"].annotation)
NORMS = get_args(ModelSpec.model_fields["norm"].annotation)
POSITIONS = get_args(ModelSpec.model_fields["position"].annotation)


class ModelSupport(SpecModel):
    """The model architectures the engine builds (its model code, not plan3d's preferences): a
    model spec outside them is refused by `recommend --engine`, `estimate --engine`, `check` and
    the engine's emitter, with the same sentence."""

    activations: list[Literal[ACTIVATIONS]] = Field(list(ACTIVATIONS), min_length=1,
                                                     description="MLP activations its layers have.")
    norms: list[Literal[NORMS]] = Field(list(NORMS), min_length=1, description="Norms its layers have.")
    positions: list[Literal[POSITIONS]] = Field(list(POSITIONS), min_length=1,
                                                description="Position encodings it has (ALiBi: bloom).")
    linear_bias: bool = Field(True, description="Linear layers with biases (GPT-2/3, BLOOM).")
    qkv_bias: bool = Field(True, description="Q/K/V projections with biases where the others have none (Qwen2).")
    mla: bool = Field(True, description="Multi-head latent attention (DeepSeek-V2/V3).")
    free_head_dim: bool = Field(True, description="A head dim other than hidden / heads (a dense model's).")
    norm_eps: list[float] | None = Field(None, description="The norm epsilons its model code can set; None: any.")
    qk_norm: bool = Field(True, description="Per-head query/key norms (Qwen3, OLMo 2) on a model without MLA.")
    rope_scalings: list[Literal["llama3", "yarn"]] = Field(["llama3", "yarn"], description="RoPE scalings it has.")
    rope_scaling_fixed: dict[Literal["llama3", "yarn"], dict[str, float]] = Field(
        default_factory=dict, description="Scaling parameters its code hardcodes, by scaling type (Megatron-Core: "
        "llama3's low/high frequency factors and original context); a model with other values is refused.")
    group_limited_routing: bool = Field(True, description="MoE routing limited to the best expert groups "
                                        "(DeepSeek n_group / topk_group).")
    top_k_scaling: bool = Field(True, description="Routing weights scaled by a factor (routed_scaling_factor).")
    unnormalized_top_k: list[Literal["softmax", "sigmoid"]] = Field(
        ["softmax", "sigmoid"], description="Routers whose top-k weights it can leave unnormalised "
        "(norm_topk_prob false).")
    builder: Text = Field("", description="What its model code builds, named in the refusal.")
    instead: Text = Field("", description="Where to go for a model it cannot build, named in the refusal.")

    def problems(self, engine: str, model: ModelSpec) -> list[str]:
        """Each way `model` is outside what `engine` builds, one sentence naming what to change."""
        unlike = [f"{what} {have} (it has {', '.join(allowed)})" for what, have, allowed in (
            ("activation", model.activation, self.activations), ("norm", model.norm, self.norms),
            ("position", model.position, self.positions)) if have not in allowed]
        if model.bias and not self.linear_bias:
            unlike.append("linear biases (it has none)")
        elif model.qkv_bias_ and not model.bias and not self.qkv_bias:
            unlike.append("Q/K/V biases (it has none)")
        if model.mla is not None and not self.mla:
            unlike.append("multi-head latent attention")
        if model.mla is None and model.moe is None and not self.free_head_dim and \
                model.head_dim_ * model.heads != model.hidden:
            unlike.append(f"head dim {model.head_dim_} x {model.heads} heads != hidden {model.hidden} "
                          "(it sets head dim = hidden / heads)")
        unlike += self._detail_problems(model)
        if not unlike:
            return []
        built = f" (its model code builds {self.builder})" if self.builder else ""
        to = f"; {self.instead}" if self.instead else "; change the model spec or use another --engine"
        return [f"{engine} cannot build {model.name}: {'; '.join(unlike)}{built}{to}"]


    def _detail_problems(self, model: ModelSpec) -> list[str]:
        """Norm epsilon, qk-norm, RoPE scaling and router details outside what it builds."""
        out = []
        if self.norm_eps is not None and model.norm_eps_ not in self.norm_eps:
            out.append(f"norm epsilon {model.norm_eps_:g} (it has {', '.join(f'{e:g}' for e in self.norm_eps)})")
        if model.qk_norm and model.mla is None and not self.qk_norm:
            out.append("per-head q/k norms (it has none)")
        out += self._rope_scaling_problems(model.rope_scaling)
        moe = model.moe
        if moe is not None:
            if moe.group_limited and not self.group_limited_routing:
                out.append(f"group-limited routing ({moe.router_groups} groups, top {moe.router_group_top_k}; it has none)")
            if moe.top_k_scaling not in (None, 1) and not self.top_k_scaling:
                out.append(f"routing weights scaled by {moe.top_k_scaling:g} (it does not scale them)")
            if not moe.normalize_top_k and moe.top_k > 1 and moe.router not in self.unnormalized_top_k:
                out.append(f"unnormalised top-k weights of a {moe.router} router (it renormalises them)")
        return out

    def _rope_scaling_problems(self, scaling) -> list[str]:
        if scaling is None:
            return []
        if scaling.type not in self.rope_scalings:
            return [f"rope scaling {scaling.type} (it has {', '.join(self.rope_scalings) or 'none'})"]
        fixed = self.rope_scaling_fixed.get(scaling.type, {})
        differ = [f"{name} {scaling.value(name):g} (it fixes {value:g})" for name, value in fixed.items()
                  if scaling.value(name) != value]
        return [f"{scaling.type} rope scaling with " + ", ".join(differ)] if differ else []


class CanRun(SpecModel):
    """The layouts the engine accepts (its own argument validation, not plan3d's preferences)."""

    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    tensor_parallel_with_pp: bool = Field(True, description="Tensor and pipeline parallelism together (DeepSpeed's "
                                          "AutoTP builds a data x tensor mesh without a pipeline axis: false).")
    zero: list[Literal[0, 1, 2, 3]] = Field([0, 1, 2, 3], min_length=1,
                                           description="ZeRO stages it runs without pipeline parallelism.")
    zero_with_pp: list[Literal[0, 1, 2, 3]] = Field([0, 1], description="ZeRO stages it runs with pp > 1.")
    zero_read_as_with_pp: dict[Literal["0", "1", "2", "3"], Literal[0, 1, 2, 3]] = Field(
        default_factory=dict, description="With pp > 1, a ZeRO stage named for what the engine runs as another "
        "(Megatron-Core {'2': 1}: papers call its distributed optimizer ZeRO-2, since it reduce-scatters gradients into "
        "the optimizer shard, but it keeps the whole gradient buffer: ZeRO-1 memory); estimate and check accept the "
        "name with a note instead of refusing it.")
    sequence_parallel: bool = True
    sequence_parallel_required: bool = Field(False, description="Tensor parallelism always shards the "
                                             "norms and dropout over the sequence (torchtitan).")
    interleaving: bool | None = Field(None, description="Legacy (profiles and plans before `schedules`): false "
                                      "drops the schedules with several model chunks per rank from `schedules`.")
    schedules: list[str] = Field(["1f1b", "interleaved-1f1b"], min_length=1, description="The pipeline schedules it "
                                 "runs (bundled/pipeline_schedules.yaml); the first two are what vpp alone selects.")
    zero_with_zero_bubble: list[Literal[0, 1, 2, 3]] = Field([0, 1, 2, 3], description="ZeRO stages it runs under a "
                                                             "zero-bubble schedule (deferred weight gradients: zb1p, "
                                                             "zbv, dualpipev, dualpipe).")
    recompute: list[Recompute] = Field(["none", "selective", "full"], min_length=1)
    orders: list[str] = Field([DEFAULT_ORDER, "tp-cp-ep-pp-dp"], min_length=1)
    uneven_pipeline: UnevenSplit = Field("explicit", description="none: layers must divide pp*vpp; explicit: "
                                         "per-stage layer counts are accepted; embedding-as-layer: the "
                                         "embedding and the output layer count as pipeline layers "
                                         "(Megatron-DeepSpeed `partition-method type:transformer|embedding`).")
    context_parallel: bool = False
    cp_comm: list[CpComm] = Field(["p2p"], min_length=1, description="How it can exchange K/V with context "
                                  "parallelism (Megatron-Core --cp-comm-type): " + CP_COMM_HELP + ".")
    ep_dispatchers: list[EpDispatcher] = Field(["alltoall"], min_length=1, description="How it can move tokens "
                                               "to their experts with ep > 1: " + EP_DISPATCHER_HELP + ".")
    padded_capacity_dispatchers: list[EpDispatcher] = Field(
        ["alltoall", "deepep", "hybridep"], description="The dispatchers it runs with a model's capacity_factor "
        "(experts padded to their capacity); Megatron-Core's deepep backend refuses the padding.")
    ep_overlaps: list[EpOverlap] = Field(["none"], min_length=1, description="How it can hide the all-to-alls with "
                                         "ep > 1: " + EP_OVERLAP_HELP + ".")
    act_offloads: list[ActOffload] = Field(["none"], min_length=1, description="Which activations it can move to "
                                           "host memory between the forward and the backward: " + ACT_OFFLOAD_HELP + ".")
    expert_parallel: bool = Field(False, description="Expert parallelism for mixture-of-experts models "
                                  "(ep > 1: each MoE layer's experts split over ep of the dp*cp ranks).")
    sequence_parallel_with_moe: bool = Field(False, description="A mixture-of-experts model with tp > 1 needs "
                                             "sequence parallelism, at any ep (Megatron-Core 0.19: MoELayer.forward "
                                             "raises; ModelParallelConfig only warns).")
    expert_parallel_with_tp: bool = Field(True, description="ep > 1 together with tp > 1 (DeepSpeed AutoEP and "
                                          "torchtitan keep each expert whole, plan3d splits experts over tp: false).")
    expert_parallel_zero: list[Literal[0, 1, 2, 3]] = Field([0, 1, 2, 3], min_length=1, description="ZeRO "
                                                             "stages it runs with ep > 1 (torchtitan takes its "
                                                             "expert-parallel ranks from FSDP's: 2, 3).")
    expert_parallel_dp_last_order: bool = Field(True, description="pp > 1 in the order tp-cp-ep-pp-dp for "
                                                "any ep and cp; false: only ep = cp there, dense models "
                                                "included (Megatron-Core initialize_model_parallel asserts "
                                                "that the expert data-parallel size dp*cp/ep equals dp).")
    expert_tensor_parallel: bool = Field(False, description="An expert tensor-parallel degree other than tp "
                                         "(etp: MoE Parallel Folding, Megatron-Core --expert-tensor-parallel-size).")
    moe_bias_with_tp: bool = Field(True, description="An MoE model whose experts carry biases with an expert tp > 1 "
                                   "(Megatron-Core 0.19: expert biases need expert tensor parallel 1; false).")
    models: ModelSupport = ModelSupport()

    @field_validator("schedules")
    @classmethod
    def _known_schedules(cls, value: list[str]) -> list[str]:
        names = schedule_names()
        unknown = [s for s in value if s not in names]
        if unknown:
            raise ValueError(f"unknown pipeline schedule {unknown[0]!r}: choose from {', '.join(names)}")
        return value

    @model_validator(mode="after")
    def _legacy_interleaving(self) -> "CanRun":
        if self.interleaving is False:
            kept = [s for s in self.schedules if schedules()[s].chunks[0] == 1]
            object.__setattr__(self, "schedules", kept or ["1f1b"])
        return self

    @property
    def max_chunks(self) -> int | None:
        """The most model chunks per rank any of its schedules runs (None: no bound)."""
        highs = [schedules()[s].chunks[1] for s in self.schedules]
        return None if None in highs else max(highs)

    @field_validator("orders")
    @classmethod
    def _orders_are_valid(cls, orders: list[str]) -> list[str]:
        try:
            return ["-".join(parse_order(order)) for order in orders]  # short forms stored in full
        except LayoutError as err:  # reported with the spec file's other problems
            raise ValueError(str(err)) from None


class OverlapConflict(SpecModel):
    """Tensor-parallel communication overlap that the engine cannot run next to its sharded data
    parallelism on some GPU generations: with ZeRO `zero` and tp > 1, on `generations`, the TP
    collectives are not hidden (the cost model drops `tp_overlap_fraction`, the emitter leaves the
    overlap flag off and says so)."""

    zero: list[Literal[0, 1, 2, 3]] = Field(description="ZeRO stages the conflict comes with.")
    generations: list[Name] = Field(description="GPU generations (GPUSpec.generation) it holds on.")
    why: Text = Field(description="The engine's own reason (its code or documentation).")

    def drops_tp_overlap(self, zero, generation: str):
        """Whether the conflict switches TP overlap off for `zero` (a stage or an array of stages)."""
        return np.isin(zero, self.zero) & (generation in self.generations)


GradDtype = Literal["fp32", "bf16", "fp16"]


class GradientBuffer(SpecModel):
    """The buffer an engine accumulates gradients in over the micro-batches of a step, by training
    precision (fp8 keeps bf16 master gradients and reads `bf16`; fp32 training keeps fp32). The
    buffer's dtype is also what the data-parallel reduction moves. A training spec's
    `fp32_grad_accum` (true or false) overrides it."""

    bf16: Literal["fp32", "bf16"] = Field("fp32", description="bf16 training: fp32 (Megatron-LM/-Core: bf16 "
                                          "forces --accumulate-allreduce-grads-in-fp32 unless --grad-reduce-in-bf16; "
                                          "FSDP2 MixedPrecisionPolicy(reduce_dtype=float32)) or bf16.")
    fp16: Literal["fp32", "fp16"] = Field("fp16", description="fp16 training: fp16 (Megatron's default without "
                                          "--accumulate-allreduce-grads-in-fp32; DeepSpeed's fp16 optimizers) or fp32.")
    keeps_16bit_grads: bool = Field(False, description="Next to an fp32 buffer, the parameters' own 16-bit .grad "
                                    "tensors stay allocated (2 more bytes per parameter): DeepSpeed's BF16_Optimizer "
                                    "adds each bf16 grad into its fp32 flat buffer and zeroes it, never frees it; "
                                    "Megatron writes the weight gradients straight into main_grad (no 16-bit copy).")
    unsharded_step_cast_bytes: Literal[4, 8] = Field(
        4, description="Without ZeRO, 16-bit gradients: the bytes per parameter the optimizer step's fp32 gradient "
        "copy takes at its peak. 4: one fp32 copy (Megatron's Float16Optimizer, main_param.grad = main_grad.float()). "
        "8: DeepSpeed's FP16_Optimizer (runtime/fp16/fused_optimizer.py step()) casts every parameter's .grad of a group "
        "to fp32 and then flattens that list, so the per-parameter copies and the flat copy are both alive. ZeRO-1/2 "
        "cast the rank's flat partition once (stage_1_and_2.py): 4, sharded.")

    def dtype(self, precision: str) -> str:
        if precision == "fp32":
            return "fp32"
        return self.fp16 if precision == "fp16" else self.bf16


class RunsAs(SpecModel):
    """How the engine runs a layout, as the cost model needs it."""

    attention: Literal["flash", "unfused"] | None = Field(
        None, description="flash: scores never reach HBM; unfused: scores, softmax and dropout go through "
        "HBM (attention_score_bytes per score element); empty: the GPU spec's value.")
    selective: Literal["attention-core", "per-op"] = Field(
        "attention-core", description="What `selective` recompute is in this engine. attention-core: the "
        "attention core alone is recomputed (Korthikanti et al. 2022; Megatron --recompute-granularity "
        "selective); per-op: torchtitan's SelectiveAC, a per-op policy that saves the block's input, the "
        "outputs of every other linear (the 1st, 3rd, ...), the attention kernel and the collectives, and "
        "recomputes the rest (torchtitan/distributed/activation_checkpoint.py, _get_custom_policy).")
    zero3_collectives: Literal["ring", "per-gpu-nic"] = Field(
        "ring", description="ring: parameter gathers and gradient reduce-scatters of ZeRO-3 use the "
        "bandwidth of every NIC of a node (NCCL's rings, one per NIC); per-gpu-nic: each GPU gets only its "
        "own NIC share (one small collective per parameter, DeepSpeed ZeRO-3 of 2021).")
    zero3_collectives_per_layer: float = bounded(
        1.0, dict(ge=1, le=1000), description="ZeRO-3 parameter gathers (and gradient reduce-scatters) per "
        "transformer layer and pass, each paying the ring's latency over the data-parallel group: 1 for FSDP2 "
        "(one unit per block) and Megatron-FSDP; DeepSpeed fetches submodule by submodule, one gather per "
        "weight above stage3_param_persistence_threshold (QKV, attention output, the MLP's two: 4).")
    zero3_recompute_regathers: bool = Field(
        True, description="ZeRO-3 with full recompute: the recompute's forward gathers the layer's parameters "
        "again (three gathers per micro-batch: DeepSpeed's per-module fetch and release); false: the gather of "
        "the recompute serves the backward too (two: FSDP2 unshards in its pre-backward hook and skips the "
        "recompute's reshard, torch/distributed/fsdp/_fully_shard/_fsdp_state.py _pre_forward; Megatron-FSDP "
        "'gather parameters once for both the recomputation and backward computation', megatron_fsdp.py).")
    sharded_zero: list[Literal[2, 3]] = Field(
        [3], description="ZeRO stages the engine runs through its fully sharded data-parallel implementation "
        "(Megatron-Core: Megatron-FSDP for 2 and 3); their predictions form the ZeRO-3/FSDP region of the error "
        "bands, apart from the distributed-optimizer runs of ZeRO 0-2.")
    zero3_overlap_fraction: float | None = bounded(
        None, FRACTION, description="Share of the compute that hides ZeRO-3 parameter gathers and gradient "
        "reduce-scatters (prefetch); empty: the data-parallel overlap fraction.")
    grad_reduce: Literal["overlapped", "after-backward"] | None = Field(
        None, description="overlapped: bucketed gradient reduction during the backward "
        "(dp_overlap_fraction of one micro-batch's backward hides it); after-backward: none hidden; "
        "empty: the GPU spec's dp_overlap_fraction.")
    param_gather_overlap: bool = Field(False, description="ZeRO-1/2 parameter all-gather after the optimizer "
                                       "step overlapped with the next step's first forward (Megatron-Core "
                                       "--overlap-param-gather, FSDP2 prefetch); false: exposed after the step.")
    tp_overlap_fraction: float = bounded(0.0, FRACTION, description="Share of the tensor-parallel "
                                       "collectives hidden behind the layer's GEMMs (Megatron-Core --tp-comm-overlap "
                                       "with Transformer Engine userbuffers); 0: blocking.")
    tp_overlap_conflict: OverlapConflict | None = Field(
        None, description="Where the TP overlap cannot run next to sharded data parallelism (None: nowhere).")
    ep_overlap_fraction: float = bounded(0.0, FRACTION, description="Share of the expert-parallel all-to-alls "
                                         "(MoE dispatch and combine) hidden behind compute (Megatron-Core "
                                         "--overlap-moe-expert-parallel-comm with the 1F1B A2A overlap); 0: exposed.")
    shared_expert_overlap: bool = Field(False, description="The shared experts run on a side stream while "
                                        "the dispatch and combine all-to-alls are in flight, hiding them up to the "
                                        "shared experts' time (Megatron-Core --moe-shared-expert-overlap).")
    f_b_overlap: bool = Field(False, description="Under a schedule that pairs one micro-batch's forward chunk with "
                              "another's backward chunk (f_b_overlap in bundled/pipeline_schedules.yaml: DualPipe, "
                              "DualPipeV), the pair runs concurrently, so the expert-parallel all-to-alls of one "
                              "hide behind the other's computation (DeepSeek-V3 report sec. 3.2.1); false: the pair "
                              "runs one after the other (torch's ScheduleDualPipeV without an OVERLAP_F_B callback, "
                              "torchtitan 0.3 eager).")
    f_b_comm_sm_share: float = bounded(0.0, FRACTION, description="Share of the GPU's SMs the overlapped "
                                       "all-to-alls occupy, slowing the computation they hide behind (DeepSeek-V3 "
                                       "report sec. 3.2.2: 20 of the H800's 132 SMs, 0.15).")
    ep_dispatcher: EpDispatcher = Field("alltoall", description="The token dispatcher it runs with ep > 1, one of "
                                        "can_run.ep_dispatchers (`--ep-dispatcher` chooses another).")
    ep_overlap: EpOverlap = Field("none", description="How it hides the all-to-alls with ep > 1, one of "
                                  "can_run.ep_overlaps (`--ep-overlap` chooses another); combined-1f1b hides them "
                                  "behind the other micro-batch's computation on the SMs f_b_comm_sm_share leaves.")
    act_offload: ActOffload = Field("none", description="The activations it offloads to host memory, one of "
                                    "can_run.act_offloads (`--act-offload` chooses another).")
    cp_comm: CpComm = Field("p2p", description="The K/V exchange it runs with context parallelism, one of "
                            "can_run.cp_comm (`--cp-comm` chooses another).")
    cp_gathered_kv_saved: bool = Field(False, description="The other ranks' K/V are saved for the backward "
                                       "(autograd of the exchange: torch's flex_cp_allgather, plan3d's runtime): "
                                       "all_gather's backward only reduce-scatters dK/dV and p2p's backward sends "
                                       "only dK/dV, but every layer keeps cp - 1 more K/V chunks; false: the "
                                       "backward fetches K/V again (Transformer Engine).")
    cp_ring_overlap: bool = Field(True, description="p2p: each K/V transfer of the ring overlaps the attention "
                                  "of the block before it (Transformer Engine's side streams); false: synchronous "
                                  "shifts, every transfer exposed.")
    gradients: GradientBuffer = GradientBuffer()

    @property
    def combined_1f1b(self) -> bool:
        """The all-to-alls hide as Megatron-Core's combined 1F1B (`ep_overlap`)."""
        return self.ep_overlap == "combined-1f1b"

    reduce_bucket_elements: float = bounded(0.0, dict(ge=0, le=1e13), description="A flat buffer of this many "
                                            "gradient elements (in the gradient dtype, at most the rank's gradients) "
                                            "that the gradient reduction copies buckets into (DeepSpeed: the ZeRO "
                                            "ipg buffer and the buffered all-reduce, reduce_bucket_size 5e8); 0: "
                                            "the reduction runs in place on the gradient buffer (Megatron).")
    logit_bytes: float = bounded(4.0, dict(ge=0, le=64), description="Bytes per logit element the last stage holds "
                                 "at the loss's peak, for one micro-batch (its s*B*V/tp logits): 4, an fp32 copy "
                                 "(plan3d's runtime); 6, the bf16 output plus the fp32 copy the loss saves (Megatron's "
                                 "vocab_parallel_cross_entropy(logits.float()) keeps exp_logits); 10, plus an fp32 "
                                 "log_softmax (torch's cross_entropy(pred.float()): torchtitan, Hugging Face models).")
    moe_combine_output_bytes: float | None = bounded(None, dict(ge=0, le=8), description="Bytes per element "
                                                     "of the routed experts' output (routed tokens x h) that the "
                                                     "combine keeps for its backward: 0, the router probabilities "
                                                     "scale the experts' activation instead, so the combine is a "
                                                     "pure permutation (Megatron-Core since MR 2668, 2025-04, "
                                                     "'Memory efficient token permutation'); 4, an fp32 copy "
                                                     "multiplied by the scores (torchtitan's combine); empty: the "
                                                     "output at the activation dtype (a multiply in the unpermute).")
    fsdp_unsharded_with_pp: bool = Field(False, description="With pp > 1, FSDP (ZeRO 2/3) keeps the stage's parameters "
                                         "gathered and its gradients unsharded in fp32 across the micro-batches, "
                                         "reduce-scattering once after the last (torchtitan: reshard_after_forward = "
                                         "not pp_enabled; torch.distributed.pipelining defers gradient sync to the last "
                                         "backward and FSDP2 accumulates the unsharded grad in reduce_dtype).")
    zero3_live_params: float = bounded(0.0, dict(ge=0, le=1e15), description="ZeRO-3: the most parameters held "
                                       "gathered at once (DeepSpeed stage3_max_live_parameters, 1e9 by default: it "
                                       "gathers module by module); 0: two whole layers (the one computing and the "
                                       "one prefetched: FSDP2 units, Megatron-FSDP).")
    pipeline_outputs_kept: bool = Field(False, description="Each pipeline stage keeps its output activation of "
                                        "every micro-batch in flight until its backward (DeepSpeed PipelineEngine "
                                        "pipe_buffers['outputs']); false: freed once sent (Megatron's "
                                        "deallocate_output_tensor, Korthikanti et al. 2022 Appendix B).")
    fused: list[Text] = Field(default_factory=list, description="Fused kernels (documentation).")


class SoftwareEfficiency(SpecModel):
    """Fitted values of the engine's software; None: the GPU spec's value (see ComputeEfficiency)."""

    elementwise_bytes: float | None = bounded(None, BYTES_PER_ELEMENT)
    attention_score_bytes: float | None = bounded(None, BYTES_PER_ELEMENT)
    layer_overhead_s: float | None = bounded(None, OVERHEAD_S)
    micro_batch_overhead_s: float | None = bounded(None, OVERHEAD_S)
    dp_overlap_fraction: float | None = bounded(None, FRACTION)
    reserved_memory_gib: float | None = bounded(None, dict(ge=0, le=1e6), description="Memory no formula sees "
                                                "under this engine (CUDA context, NCCL buffers, library workspaces); "
                                                "empty: the GPU spec's reserved_memory_gib.")
    allocator_overhead_fraction: float = bounded(0.0, dict(ge=0, le=10), description="What the caching allocator "
                                                 "holds beyond the live activations and buffers at the peak (freed blocks "
                                                 "kept cached, fragmentation), as a share of them; reported in the reserve "
                                                 "row. Fitted on nvidia-smi peaks where the engine has some; 0: not fitted.")
    gemm_efficiency_scale: float = bounded(1.0, EFFICIENCY, description="The share of the GPU's GEMM ceiling "
                                         "(compute_efficiency.max_fraction) the engine's kernels reach: older "
                                         "PyTorch/cuBLAS, unfused bias adds and layout copies around its GEMMs.")
    fitted_on: Text = Field("", description="The data the values were fitted on (empty: not fitted).")
    calibrated_zero: list[Literal[0, 1, 2, 3]] = Field(
        default_factory=list, description="ZeRO stages of the runs the values were fitted on; a layout with "
        "another stage is flagged as outside the validated region (empty: not stated).")
    calibrated_gpus: list[Name] = Field(default_factory=list, description="GPU specs (by name) of the runs the "
                                       "values were fitted on; on other GPUs a prediction is flagged as outside "
                                       "the validated region.")


# The job settings an engine profile runs one of (runs_as.<field>, from can_run.<options>) and a
# command-line option chooses: (options field, value kinds, the option, the can_run capability it
# needs, that capability's name).
RUN_CHOICES = {
    "cp_comm": ("cp_comm", CpComm, "--cp-comm", "context_parallel", "context parallelism"),
    "ep_dispatcher": ("ep_dispatchers", EpDispatcher, "--ep-dispatcher", "expert_parallel", "expert parallelism"),
    "ep_overlap": ("ep_overlaps", EpOverlap, "--ep-overlap", "expert_parallel", "expert parallelism"),
    "act_offload": ("act_offloads", ActOffload, "--act-offload", "", "activation offloading"),
}


class EngineSpec(SpecModel):
    name: Name
    description: Text = ""
    version: Text = Field("", description="The releases the profile describes.")
    can_run: CanRun = CanRun()
    runs_as: RunsAs = RunsAs()
    efficiency: SoftwareEfficiency = SoftwareEfficiency()
    source: Text = ""

    @model_validator(mode="after")
    def _choices_are_runnable(self) -> "EngineSpec":
        for field, (options, *_) in RUN_CHOICES.items():
            if getattr(self.runs_as, field) not in getattr(self.can_run, options):
                raise ValueError(f"runs_as.{field} {getattr(self.runs_as, field)!r} is not in can_run.{options} "
                                 f"{getattr(self.can_run, options)}: add it there or set runs_as.{field} to one of them")
        return self

    def with_choice(self, field: str, value: str | None) -> "EngineSpec":
        """The profile running `field` (a RUN_CHOICES key: cp_comm, ep_dispatcher) as `value`
        (None: unchanged); one it cannot run is a LayoutError naming what it runs."""
        if value is None:
            return self
        options, kinds, flag, needs, capability = RUN_CHOICES[field]
        if needs and not getattr(self.can_run, needs):
            raise LayoutError(f"{self.name} has no {capability}: drop {flag}")
        if value == getattr(self.runs_as, field):
            return self
        if value not in getattr(self.can_run, options):
            what = f"cannot run {flag} {value}" if value in get_args(kinds) else f"has no {flag} {value!r}"
            raise LayoutError(f"{self.name} {what}; use one of {', '.join(getattr(self.can_run, options))}")
        return self.model_copy(update={"runs_as": self.runs_as.model_copy(update={field: value})})

    def with_cp_comm(self, cp_comm: str | None) -> "EngineSpec":
        """The profile running context parallelism's K/V exchange as `cp_comm` (`with_choice`)."""
        return self.with_choice("cp_comm", cp_comm)

    def with_ep_dispatcher(self, dispatcher: str | None) -> "EngineSpec":
        """The profile moving MoE tokens with `dispatcher` (`with_choice`)."""
        return self.with_choice("ep_dispatcher", dispatcher)

    def cp_comm_problems(self, layout: LayoutShape, model: ModelSpec | None) -> list[str]:
        """a2a splits each rank's heads over cp (Transformer Engine AttnFuncWithCPAndQKVOA2A):
        heads / tp and kv_heads / tp must both divide by cp."""
        if layout.cp == 1 or self.runs_as.cp_comm != "a2a" or model is None:
            return []
        heads, kv = model.heads // layout.tp, model.kv_heads_ // layout.tp
        if heads % layout.cp == 0 and kv % layout.cp == 0:
            return []
        cps = [c for c in range(2, math.gcd(heads, kv) + 1) if math.gcd(heads, kv) % c == 0]
        tps = [t for t in range(1, model.kv_heads_ + 1) if model.kv_heads_ % t == 0 and model.heads % t == 0
               and (model.heads // t) % layout.cp == 0 and (model.kv_heads_ // t) % layout.cp == 0]
        fixes = ["--cp-comm p2p"] + ([f"cp in {{{', '.join(map(str, cps))}}} at tp={layout.tp}"] if cps else [])
        fixes += [f"tp in {{{', '.join(map(str, tps))}}} for cp={layout.cp}"] if tps else []
        return [f"--cp-comm a2a splits heads over cp: {heads} heads and {kv} KV heads per tp rank do not divide "
                f"by cp={layout.cp}; use {' or '.join(fixes)}"]

    def grad_dtype(self, training: TrainingSpec) -> str:
        """The dtype the engine accumulates and reduces gradients in (`grad_dtype`)."""
        return grad_dtype(training, self)

    def software_values(self) -> dict[str, float]:
        """The fitted values the engine sets (the rest come from the GPU spec)."""
        values = {k: getattr(self.efficiency, k) for k in SOFTWARE_KEYS}
        if self.runs_as.grad_reduce == "after-backward":
            values["dp_overlap_fraction"] = 0.0
        if self.runs_as.attention == "flash":
            values["attention_score_bytes"] = 0.0
        return {k: v for k, v in values.items() if v is not None}

    def default_split(self, layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
        """Layers per virtual stage when pp*vpp does not divide the layers (None: even, or refused).

        An engine that takes per-stage counts (`explicit`: Megatron-Core's
        `--pipeline-model-parallel-layout` / first-last stage flags, torchtitan's
        `module_fqns_per_model_part`) gets `balanced_split`, which `emit` writes out.

        Megatron-DeepSpeed's `type:transformer|embedding` partition counts the embedding and the
        output layer as one layer each and balances layers + 2 over the stages, so BLOOM's 70
        layers on 12 stages run as 5, 6 x 10, 5 (BigScience tr11 README)."""
        chunks = pp * vpp
        if self.can_run.uneven_pipeline == "none" or layers % chunks == 0 or chunks < 2 or chunks > layers:
            return None
        if self.can_run.uneven_pipeline == "explicit":  # per-stage counts the job states: the balanced split
            return balanced_split(layers, chunks)
        units = layers + 2
        base, extra = divmod(units, chunks)
        split = [base + (1 if i < extra else 0) for i in range(chunks)]
        split[0] -= 1
        split[-1] -= 1
        return tuple(split) if min(split) >= 1 else None

    def model_problems(self, model: ModelSpec) -> list[str]:
        """Every way the engine's model code cannot build `model` (`can_run.models`), or cannot move
        its tokens with the dispatcher it runs (`can_run.padded_capacity_dispatchers`)."""
        out = self.can_run.models.problems(self.name, model)
        dispatcher = self.runs_as.ep_dispatcher
        if model.moe is not None and model.moe.capacity_factor is not None and \
                dispatcher not in self.can_run.padded_capacity_dispatchers:
            out.append(f"{self.name}'s {dispatcher} dispatcher cannot pad experts to their capacity (the model's "
                       f"capacity_factor {model.moe.capacity_factor:g}); use --ep-dispatcher "
                       f"{' or '.join(self.can_run.padded_capacity_dispatchers)}, or drop the capacity_factor")
        if model.moe is None and self.runs_as.act_offload == "experts":
            out.append(f"--act-offload experts moves the routed experts' activations; {model.name} is dense: "
                       "use --act-offload all or none")
        return out

    def job_problems(self, layout: LayoutShape, model: ModelSpec, training: TrainingSpec) -> list[str]:
        """Everything the engine refuses of a job: of its layout (`layout_problems`) and of its
        training (`training_problems`). The one call every command makes."""
        return self.layout_problems(layout, model) + self.training_problems(training)

    def training_problems(self, training: TrainingSpec) -> list[str]:
        """What the engine's run choices refuse of the training's precision: Megatron-Core's
        combined-1F1B overlap runs only a bf16 or fp16 model (TransformerConfig asserts it; fp8
        keeps a bf16 model)."""
        if self.runs_as.combined_1f1b and training.precision == "fp32":
            return [f"{self.name} runs --ep-overlap combined-1f1b only with a bf16 or fp16 model "
                    "(TransformerConfig asserts it): use --precision bf16, or --ep-overlap none"]
        return []

    def offload_problems(self, recompute: str) -> list[str]:
        """The engine's rule for its activation offload next to `recompute` (OFFLOAD_REFUSED_RECOMPUTE):
        the expert modules cannot be offloaded inside a recomputed MoE block."""
        if set(EXPERT_OFFLOAD_MODULES) & set(ACT_OFFLOAD_MODULES[self.runs_as.act_offload]) and \
                recompute in OFFLOAD_REFUSED_RECOMPUTE:
            return [f"{self.name} cannot offload the experts' activations (--act-offload {self.runs_as.act_offload}) "
                    f"while recomputing the whole MoE block ({recompute} recompute; TransformerConfig asserts it): "
                    "use moe-act, selective, none or full recompute, or --act-offload none"]
        return []

    def with_act_offload(self, offload: str | None) -> "EngineSpec":
        """The profile offloading `offload` activations to host memory (`with_choice`)."""
        return self.with_choice("act_offload", offload)

    def layout_problems(self, layout: LayoutShape, model: ModelSpec | None = None) -> list[str]:
        """Every reason the engine cannot run `layout` (of `model`, where given), each a sentence that
        says what to change."""
        can, name = self.can_run, self.name
        out = self.model_problems(model) if model is not None else []
        if layout.tp > 1 and not can.tensor_parallel:
            out.append(f"{name} has no tensor parallelism: use tp=1")
        if layout.pp > 1 and not can.pipeline_parallel:
            out.append(f"{name} has no pipeline parallelism: use pp=1")
        if layout.tp > 1 and layout.pp > 1 and not can.tensor_parallel_with_pp:
            out.append(f"{name} runs tensor parallelism only without a pipeline: use tp=1 or pp=1")
        allowed = can.zero_with_pp if layout.pp > 1 else can.zero
        if layout.zero not in allowed:
            where = "with pipeline parallelism" if layout.pp > 1 else "without pipeline parallelism"
            out.append(f"{name} cannot run ZeRO-{layout.zero} {where}; use zero in {_fmt(allowed)}")
        if layout.sequence_parallel and not can.sequence_parallel:
            out.append(f"{name} has no sequence parallelism: drop it")
        if can.sequence_parallel_required and layout.tp > 1 and not layout.sequence_parallel:
            out.append(f"{name} always shards norms over the sequence with tp > 1: set sequence_parallel")
        zero_bubble = bool(is_zero_bubble(code_of(layout.pipeline_schedule)))
        if layout.pp > 1 and zero_bubble and layout.zero not in can.zero_with_zero_bubble:
            out.append(f"{name} cannot run ZeRO-{layout.zero} under the {layout.pipeline_schedule} schedule; use zero "
                       f"in {_fmt(can.zero_with_zero_bubble)} or a 1F1B schedule")
        if layout.pp > 1 and layout.pipeline_schedule not in can.schedules:
            fix = "use vpp=1" if can.max_chunks == 1 else "set the schedule (and vpp) to one of them"
            out.append(f"{name} has no {layout.pipeline_schedule} pipeline schedule; it runs "
                       f"{', '.join(can.schedules)}: {fix}")
        if layout.recompute not in can.recompute:
            out.append(f"{name} has no {layout.recompute} recompute; use one of {', '.join(can.recompute)}")
        out += self.offload_problems(layout.recompute)
        if layout.order not in can.orders:
            out.append(f"{name} places ranks only as {' or '.join(can.orders)}; set the order to one of them")
        if layout.cp > 1 and not can.context_parallel:
            out.append(f"{name} has no context parallelism in plan3d's model: use cp=1")
        if getattr(layout, "ep", 1) > 1 and not can.expert_parallel:
            out.append(f"{name} has no expert parallelism: use ep=1")
        if getattr(layout, "etp", None) is not None and not can.expert_tensor_parallel:
            out.append(f"{name} splits experts over tp only: drop etp (expert tensor parallel = tp)")
        out += self._expert_parallel_problems(layout)
        moe = model is not None and model.moe is not None
        expert_tp = getattr(layout, "etp", None) or layout.tp
        if moe and model.bias and expert_tp > 1 and not can.moe_bias_with_tp:
            fix = "set etp=1" if can.expert_tensor_parallel else "use tp=1"
            out.append(f"{name} runs experts with biases only without tensor parallelism (expert tensor "
                       f"parallel 1): {fix} or a model without biases")
        if can.sequence_parallel_with_moe and moe and layout.tp > 1 and not layout.sequence_parallel:
            out.append(f"{name} runs a mixture-of-experts model with tp > 1 only with sequence parallelism: "
                       "set sequence_parallel")
        out += self.cp_comm_problems(layout, model)
        if layout.pp_layers is not None and len(set(layout.pp_layers)) > 1 and can.uneven_pipeline == "none":
            out.append(f"{name} splits layers evenly over pipeline stages only: drop pp_layers")
        return out

    def _expert_parallel_problems(self, layout: LayoutShape) -> list[str]:
        """The engine's rules for ep > 1 together with tp, ZeRO and the rank order."""
        can, name, ep = self.can_run, self.name, getattr(layout, "ep", 1)
        dp_last = layout.order.endswith("-dp") and layout.pp > 1
        out = []
        etp = getattr(layout, "etp", None)
        expert_dp = layout.tp * layout.cp * layout.dp // (ep * (etp or layout.tp))
        if dp_last and not can.expert_parallel_dp_last_order and expert_dp != layout.dp:
            needs = f"ep = cp ({layout.cp})" if etp is None else f"an expert-data-parallel size equal to dp ({layout.dp})"
            out.append(f"{name} runs the order {layout.order} with pp > 1 only with {needs}; "
                       f"use the order {DEFAULT_ORDER}")
        if ep == 1 or not can.expert_parallel:
            return out
        if layout.tp > 1 and not can.expert_parallel_with_tp:
            out.append(f"{name} keeps each expert whole and cannot split it over tp with ep > 1: use tp=1 or ep=1")
        if layout.zero not in can.expert_parallel_zero:
            out.append(f"{name} runs ep > 1 with ZeRO {_fmt(can.expert_parallel_zero)} only; "
                       f"set zero to one of them or ep=1")
        if self.runs_as.combined_1f1b:
            if layout.pp > 1 and layout.vpp == 1:
                out.append(f"{name} runs --ep-overlap combined-1f1b with pp > 1 only on a virtual pipeline "
                           "(schedules.py asserts it): set vpp > 1 or --ep-overlap none")
            if layout.recompute in COMBINED_1F1B_REFUSED_RECOMPUTE:
                out.append(f"{name} runs --ep-overlap combined-1f1b without {layout.recompute} recompute "
                           "(TransformerConfig asserts it): use none, selective or moe-act recompute, or --ep-overlap none")
        return out

    def with_ep_overlap(self, overlap: str | None) -> "EngineSpec":
        """The profile hiding the all-to-alls as `overlap` (`with_choice`)."""
        return self.with_choice("ep_overlap", overlap)

    def resolve_split(self, layout: LayoutShape, model: ModelSpec) -> LayoutShape:
        """`layout` as the engine runs it: its own uneven split filled in where it makes one, and a
        ZeRO stage it reads as another with pp > 1 (`zero_read_as`)."""
        layout = self.zero_read_as(layout)
        if layout.pp_layers is not None:
            return layout
        split = self.default_split(model.layers, layout.pp, layout.vpp)
        return layout if split is None else layout.model_copy(update={"pp_layers": split})

    def split_note(self, layout: LayoutShape, model: ModelSpec) -> str | None:
        """The note for a split the engine's job must state that plan3d chose (`default_split` of
        an `explicit` engine, for a layout given without pp_layers); None where there is none."""
        if layout.pp_layers is not None or self.can_run.uneven_pipeline != "explicit":
            return None
        split = self.default_split(model.layers, layout.pp, layout.vpp)
        if split is None:
            return None
        return (f"pp*vpp = {layout.pp * layout.vpp} does not divide {model.layers} layers: split as "
                f"{split_text(split)} per (virtual) stage, the first and last stages lighter, as recommend "
                "searches it and emit writes it (set pp_layers for another split)")

    def zero_read_as(self, layout: LayoutShape) -> LayoutShape:
        """The layout with a ZeRO stage named for what the engine runs as another
        (`can_run.zero_read_as_with_pp`, pp > 1 only)."""
        stage = self.can_run.zero_read_as_with_pp.get(str(layout.zero)) if layout.pp > 1 else None
        return layout if stage is None else layout.model_copy(update={"zero": stage})

    def zero_note(self, layout: LayoutShape) -> str | None:
        """The note for a ZeRO stage read as another (None where none is)."""
        read = self.zero_read_as(layout)
        if read.zero == layout.zero:
            return None
        return (f"ZeRO-{layout.zero} with pp > 1 read as {self.name}'s distributed optimizer, ZeRO-{read.zero} here: "
                f"optimizer states sharded over dp*cp, gradients reduce-scattered into the shard (ZeRO-2-like traffic) "
                f"but the whole gradient buffer kept (ZeRO-1 memory)")


def grad_dtype(training: TrainingSpec, engine: EngineSpec | None) -> str:
    """The gradient buffer's dtype: fp32 for fp32 training; where the training spec says
    `fp32_grad_accum` (true/false), fp32 or the 16-bit dtype; else the engine's (no engine: the
    GradientBuffer defaults, Megatron's: fp32 for bf16 and fp8, fp16 for fp16)."""
    half = "fp16" if training.precision == "fp16" else "bf16"
    if training.precision == "fp32":
        return "fp32"
    if training.fp32_grad_accum is not None:
        return "fp32" if training.fp32_grad_accum else half
    buffer = engine.runs_as.gradients if engine is not None else GradientBuffer()
    return buffer.dtype(training.precision)


def _fmt(values) -> str:
    return "{" + ", ".join(map(str, values)) + "}" if values else "{} (none)"
