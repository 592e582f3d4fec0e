"""plan3d's memory terms against Megatron-LM's own estimator, term by term.

Megatron-LM ships `megatron/training/theoretical_memory_usage.py` (`--log-theoretical-memory`):
weights and optimizer states of the most-loaded shard (6 + 12/dp bytes per parameter with the
distributed optimizer: bf16 weights, fp32 main gradients, fp32 main weights and Adam moments), and
the first pipeline stage's activations from Korthikanti et al. 2022, Table 2 (with sequence
parallelism and selective recompute; otherwise a (10 + 24/t) s b h per layer formula). For each
layout below, `emit megatron`'s arguments go through Megatron's own parse_args and validate_args,
the estimator runs on them, and plan3d's terms for the same layout are printed beside it, with what
each formula covers. Where the estimator does not model a feature (GQA, SwiGLU's third MLP
tensor, experts, flash attention without dropout) the row says so; those rows are a check of the
part it covers, not a target.

    .venv/bin/python benchmarks/megatron_memory.py     # needs `make engines` (Megatron-Core 0.19.2)
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import typing
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MEGATRON_DIR = Path(os.environ.get("PLAN3D_MEGATRON_DIR", REPO / ".venv" / "megatron-core"))
if MEGATRON_DIR.is_dir():
    sys.path.insert(0, str(MEGATRON_DIR))
if not hasattr(typing, "override"):  # Python 3.11: megatron-core 0.19 imports typing.override (PEP 698)
    typing.override = lambda func: func

from plan3d.cost.arrays import layout_arrays  # noqa: E402
from plan3d.cost.context import make_context  # noqa: E402
from plan3d.cost.memory import rank_layer_counts, stage_memory  # noqa: E402
from plan3d.emit.megatron import gpu_arch, megatron_args  # noqa: E402
from plan3d.layout import Layout  # noqa: E402
from plan3d.plan import build_plan  # noqa: E402
from plan3d.specs import schedule as schedules  # noqa: E402
from plan3d.specs.catalog import load_cluster, load_engine, load_model  # noqa: E402
from plan3d.specs.training import TrainingSpec  # noqa: E402
from plan3d.vocab import RECOMPUTE_CODES  # noqa: E402

GIB = 2**30
# name, cluster (nodes), model, global batch, layout, what Megatron's estimator leaves out
CASES = [
    ("gpt3-175b sp selective", ("dgx-a100-80g", 64), "gpt3-175b", 1536,
     dict(tp=8, pp=8, dp=8, micro_batch=1, zero=1, recompute="selective", sequence_parallel=True),
     "Korthikanti's own setting (GELU 4h, dropout, q = kv = h): both cover it; states: its count leaves out "
     "the learned position embeddings (2,048 x 12,288 on rank 0, 0.18 GiB)"),
    ("gpt3-175b no sp selective", ("dgx-a100-80g", 64), "gpt3-175b", 1536,
     dict(tp=8, pp=8, dp=8, micro_batch=1, zero=1, recompute="selective", sequence_parallel=False),
     "its (10 + 24/t) sbh per layer is plan3d's count without SP; its without-SP path adds 5% for "
     "temporaries (plan3d's reserve row): -0.6% without that"),
    ("gpt3-175b sp selective vpp4", ("dgx-a100-80g", 64), "gpt3-175b", 1536,
     dict(tp=8, pp=8, dp=8, micro_batch=1, vpp=4, zero=1, recompute="selective", sequence_parallel=True),
     "the interleaved penalty 1 + (p - 1)/(p v) on the first stage"),
    ("llama3-70b sp selective", ("dgx-h100", 64), "llama3-70b", 512,
     dict(tp=8, pp=4, dp=16, micro_batch=1, zero=1, recompute="selective", sequence_parallel=True),
     "it counts q = kv = h (its TODO: GQA's 8 KV heads of 64 are smaller), 2 MLP tensors of f "
     "(SwiGLU saves 3) and dropout masks (Llama trains without)"),
    ("mixtral-8x7b ep8 sp", ("dgx-h100", 8), "mixtral-8x7b", 256,
     dict(tp=2, pp=4, dp=8, ep=8, micro_batch=1, zero=1, recompute="selective", sequence_parallel=True),
     "weights: experts over ep x etp, their optimizer over edp; activations: no experts in its formula"),
]


def megatron_module():
    try:
        from megatron.training import arguments, theoretical_memory_usage
    except ImportError as err:
        raise SystemExit(f"megatron-core is not importable ({err}): run `make engines`") from None
    return arguments, theoretical_memory_usage


def megatron_parsed(arguments, plan, argv: list[str]):
    """Megatron's parse_args + validate_args on `argv` as rank 0 of the plan's world (no GPU: the
    device capability is the plan's GPU generation)."""
    import torch

    arch = gpu_arch(plan)
    extra = ["--train-iters", "10", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(plan.model.vocab)]
    env = {"WORLD_SIZE": str(plan.layout.world_size), "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv, *extra]), mock.patch.dict(os.environ, env), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (arch, 0)), \
            mock.patch.object(arguments, "get_device_arch_version", lambda: arch), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        args = arguments.parse_args()
        arguments.validate_args(args)
    return args


def megatron_terms(memory, args, micro_batches: int, vocab: int) -> tuple[float, float]:
    """(weights + optimizer, first-stage activations) in bytes, as Megatron's report picks them."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    args.padded_vocab_size = calculate_padded_vocab_size(vocab, args.make_vocab_size_divisible_by,
                                                         args.tensor_model_parallel_size, logging_enabled=False)
    with contextlib.redirect_stdout(io.StringIO()):
        weights = memory.compute_weight_and_optimizer_memory(args)
        if args.sequence_parallel and args.recompute_granularity == "selective":
            activations = memory.compute_activation_memory(args, num_microbatches=micro_batches)
        else:
            activations = memory.compute_activation_memory_without_sp(args, num_microbatches=micro_batches)
    return float(weights), float(activations)


def plan3d_terms(cluster, model, training, layout: Layout, engine) -> tuple[float, float]:
    """(weights + gradients + optimizer of the most-loaded rank, activations of pipeline rank 0)."""
    ctx = make_context(cluster, model, training, engine)
    la = layout_arrays(training.global_batch, [layout.tp], [layout.pp], [layout.dp], [layout.micro_batch],
                       [layout.vpp], [layout.zero], [RECOMPUTE_CODES[layout.recompute]],
                       [float(layout.sequence_parallel)], [layout.cp], [layout.ep],
                       None if layout.etp is None else [layout.etp], [schedules.code_of(layout.pipeline_schedule)])
    counts = [rank_layer_counts(model, layout, r) for r in range(layout.pp)]
    stages = [stage_memory(ctx, la, np.array([float(r)]), np.array([float(n)]), np.array([float(moe)]))
              for r, (n, moe) in enumerate(counts)]
    states = max(float(s["weights"][0] + s["gradients"][0] + s["optimizer"][0]) for s in stages)
    return states, float(stages[0]["activations"][0])


def rows() -> list[dict]:
    arguments, memory = megatron_module()
    engine = load_engine("megatron-core")
    out = []
    for name, (cluster_name, nodes), model_name, batch, knobs, covers in CASES:
        cluster, model = load_cluster(cluster_name, nodes), load_model(model_name)
        training, layout = TrainingSpec(global_batch=batch), Layout(**knobs)
        plan = build_plan(cluster, model, training, layout, engine=engine)
        args = megatron_parsed(arguments, plan, megatron_args(plan, engine))
        m_states, m_act = megatron_terms(memory, args, layout.micro_batches(training.global_batch), model.vocab)
        p_states, p_act = plan3d_terms(cluster, model, training, layout, engine)
        out.append({"case": name, "megatron_states_gib": m_states / GIB, "plan3d_states_gib": p_states / GIB,
                    "megatron_activations_gib": m_act / GIB, "plan3d_activations_gib": p_act / GIB, "covers": covers})
    return out


def main() -> None:
    table = rows()
    print("## plan3d against Megatron-LM's theoretical_memory_usage.py (megatron-core 0.19.2), GiB per GPU")
    print(f"{'case':30s} {'states M':>9s} {'plan3d':>7s} {'diff':>7s} {'act. M':>8s} {'plan3d':>7s} {'diff':>7s}  what the "
          "estimator covers")
    for r in table:
        ds = r["plan3d_states_gib"] / r["megatron_states_gib"] - 1
        da = r["plan3d_activations_gib"] / r["megatron_activations_gib"] - 1
        print(f"{r['case']:30s} {r['megatron_states_gib']:9.2f} {r['plan3d_states_gib']:7.2f} {ds:+7.1%} "
              f"{r['megatron_activations_gib']:8.2f} {r['plan3d_activations_gib']:7.2f} {da:+7.1%}  {r['covers']}")
    print("states: weights + gradients + optimizer of the most-loaded rank (Megatron: its most-loaded shard); "
          "activations: pipeline rank 0")


if __name__ == "__main__":
    main()
