"""The words every layer shares, spelled once: time terms, memory terms, step phases, recompute
modes, collective kinds.

A leaf module (it imports nothing from plan3d), so the cost model, the search, the renderers, the
run record and the runtime can all read it without importing one another. Display labels stay
with their renderers, keyed by these names.
"""
from __future__ import annotations

# ---- time of one step -------------------------------------------------------------------------
# The terms a step's predicted time is the sum of (`Estimate.time_s`), in the order the tables
# print them.
# `ep_comm`: the exposed expert-parallel all-to-alls of mixture-of-experts layers (0 for dense models).
TIME_TERMS = ("compute", "recompute", "bubble", "tp_comm", "pp_comm", "ep_comm", "offload", "overhead", "dp_comm", "zero_comm",
              "optimizer")
# The exposed communication terms among them.
COMM_TERMS = ("tp_comm", "pp_comm", "ep_comm", "dp_comm", "zero_comm")
# The terms paid once per micro-batch (the pipeline multiplies them by the micro-batch count).
PER_MICRO_BATCH_TERMS = ("compute", "recompute", "tp_comm", "pp_comm", "ep_comm", "offload", "overhead")
SECONDS_SUFFIX = "_s"


def seconds_column(term: str) -> str:
    """The name of a time term in a table of arrays with other units (`compute` -> `compute_s`)."""
    return term + SECONDS_SUFFIX


def term_of_column(column: str) -> str | None:
    """The time term a `*_s` column holds, or None when it is no time term (`step_time_s`)."""
    term = column.removesuffix(SECONDS_SUFFIX)
    return term if column.endswith(SECONDS_SUFFIX) and term in TIME_TERMS else None


TIME_COLUMNS = tuple(seconds_column(t) for t in TIME_TERMS)

# ---- utilisation: three FLOP conventions -------------------------------------------------------
# Share of the GPUs' peak (the bf16 peak, also under fp8) a step's FLOPs are, each convention by
# name (`plan3d.cost.compute`): `mfu` model FLOPs with causal attention (half the s^2 term, PaLM
# appendix B, Megatron-Core since 2025-03), `mfu_noncausal` model FLOPs with the full s^2 term
# (Narayanan et al. 2021, Korthikanti et al. 2022, Megatron-Core before 2025-03), `hfu` hardware
# FLOPs: non-causal, plus the recompute pass (Narayanan et al. 2021's reported TFLOP/s).
UTILISATION = ("mfu", "mfu_noncausal", "hfu")
UTILISATION_LABELS = {"mfu": "MFU (causal attention)", "mfu_noncausal": "MFU, attention counted non-causally",
                      "hfu": "HFU (with recompute, non-causal)"}

# ---- memory of one rank -----------------------------------------------------------------------
# The categories a rank's predicted memory is the sum of (`Estimate.memory_bytes`), in table order.
MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "buffers", "reserve")
# The model states among them: exact tensor sizes, which a run measures per rank.
MODEL_STATE_TERMS = ("weights", "gradients", "optimizer")

# ---- phases of a measured step ----------------------------------------------------------------
# What the runtime times on rank 0 in each step (metrics.jsonl `phases_s`), in step order.
PHASES = ("forward_backward", "grad_reduce", "clip", "optimizer", "loss")

# ---- recompute --------------------------------------------------------------------------------
# Activation recomputation, least to most: the integer code of a mode (in the search's and the
# cost model's arrays) is its position here, so `code >= RECOMPUTE_CODES["full"]` reads "full".
# "moe-act": Megatron-Core's `--recompute-granularity selective --recompute-modules moe_act
# layernorm` (output-discarding checkpoints of the routed experts' activation function and the
# MoE layer's pre-MLP norm; TransformerConfig.recompute_modules), mixture-of-experts models only.
# "moe": `--recompute-granularity selective --recompute-modules moe layernorm`: the whole MoE layer
# (router, dispatch, shared and routed experts, combine) under one checkpoint, recomputed with its
# all-to-alls in the backward (MoELayer.forward: tensor_parallel.checkpoint), and the pre-MLP norm.
# "mla-up": `--recompute-granularity selective --recompute-modules mla_up_proj layernorm` (+ moe_act
# for an MoE model): output-discarding checkpoints of multi-head latent attention's up-projections
# (the per-head Q, K, V rebuilt from the latents in the backward), the norms and the experts'
# activation -- what DeepSeek-V3 recomputes (arXiv 2412.19437, sec. 3.2.3 RMSNorm and MLA
# up-projection; sec. 3.3.2 the SwiGLU output from its cached input); MLA models only.
# "partial": full recompute of the first N layers of every virtual chunk, N the fewest that make
# the most-loaded rank fit (Megatron-Core `--recompute-granularity full --recompute-method block
# --recompute-num-layers N`; the estimate's `recompute_layers`).
RECOMPUTE_MODES = ("none", "selective", "moe-act", "moe", "mla-up", "partial", "full")
RECOMPUTE_CODES = {mode: code for code, mode in enumerate(RECOMPUTE_MODES)}
# Megatron-Core's --recompute-modules of each module-list mode (TransformerConfig.recompute_modules),
# read by the emitter (the flags) and the memory model (what each mode drops); the expert modules
# (moe_act, moe) apply to MoE models only.
RECOMPUTE_MODULES = {"moe-act": ("moe_act", "layernorm"), "moe": ("moe", "layernorm"),
                     "mla-up": ("mla_up_proj", "moe_act", "layernorm")}
EXPERT_RECOMPUTE_MODULES = ("moe_act", "moe")


def recompute_modules(mode: str, moe: bool) -> tuple[str, ...]:
    """The --recompute-modules of `mode` for a model with (moe) or without experts; () for the rest."""
    return tuple(m for m in RECOMPUTE_MODULES.get(mode, ()) if moe or m not in EXPERT_RECOMPUTE_MODULES)


def modes_recomputing(module: str) -> tuple[str, ...]:
    """The recompute modes whose module list holds `module` (RECOMPUTE_MODULES)."""
    return tuple(mode for mode, modules in RECOMPUTE_MODULES.items() if module in modules)

# ---- collectives ------------------------------------------------------------------------------
# The kinds of transfer a network tier prices (a spec's `collectives:` keys) and the cost model
# reads, in the order of its link tables.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
# The ring collectives among them (a group of n ranks; p2p has two ends).
RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
