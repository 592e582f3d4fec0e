"""GPU benchmark of the bundled runtime: a ~1B-parameter GPT on ONE GPU, bf16 mixed precision.

Prints tokens/s and MFU against the GPU's dense bf16 peak (from the bundled GPU spec), for eager
and torch.compile'd blocks. Target (issue 6): MFU >= 40% on one H200. Needs CUDA; exits 0 with a
note otherwise. Run:  .venv/bin/python benchmarks/gpu_runtime.py [--steps 12] [--cluster h200]

MFU = model FLOPs per token x tokens/s / peak, model FLOPs per token = 6 N + 12 L s h
(Chowdhery et al. 2022, PaLM, appendix B: weights forward + backward, plus attention scores).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

MODEL_1B = dict(name="gpt-1b", layers=18, hidden=2048, heads=16, kv_heads=8, activation="swiglu",
                ffn_hidden=5632, norm="rmsnorm", bias=False, position="rope", vocab=32000, seq_len=2048)


SMOKE = dict(MODEL_1B, name="gpt-smoke", layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=256,
             vocab=512, seq_len=128)


def _plan(cluster_name: str, global_batch: int, micro_batch: int, shape: dict = MODEL_1B):
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.plan import build_plan
    from plan3d.specs.catalog import load_cluster
    from plan3d.specs.model import ModelSpec
    from plan3d.specs.training import TrainingSpec

    cluster = load_cluster(cluster_name, 1, 1)
    model = ModelSpec(**shape)
    training = TrainingSpec(global_batch=global_batch, precision="bf16")
    layout = Layout(micro_batch=micro_batch)
    return build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict())


def _run(plan, steps: int, compile_blocks: bool, backend: str = "nccl") -> dict | None:
    from plan3d.run.launch import launch, read_summary

    run_dir = Path(tempfile.mkdtemp(prefix="gpu-runtime-"))
    extra = ["--no-save", "--warmup-steps", "3"] + (["--compile"] if compile_blocks else [])
    result = launch(plan, None, run_dir, steps, backend=backend, worker_args=extra)
    if not result.ok:
        print(f"  failed ({'compiled' if compile_blocks else 'eager'}): {result.error}; logs in {run_dir}/logs")
        return None
    return read_summary(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cluster", default="h200")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU/gloo: checks this script only")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA GPU: nothing to measure (run this on a GPU machine, or --smoke)")
        return 0
    from plan3d.cost.params import total_params

    backend = "gloo" if args.smoke else "nccl"
    plan = _plan(args.cluster, args.global_batch, args.micro_batch, SMOKE if args.smoke else MODEL_1B)
    n, m = total_params(plan.model), plan.model
    flops_per_token = 6 * n + 12 * m.layers * m.seq_len * m.hidden
    peak = plan.cluster.gpu.peak_flops("bf16")
    device = "CPU smoke run" if args.smoke else torch.cuda.get_device_name()
    print(f"{device}  model {n / 1e9:.2f}B params, seq {m.seq_len}, "
          f"global batch {args.global_batch}, micro-batch {args.micro_batch}")
    print(f"{'mode':<10}{'step_s':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}{'loss':>9}")
    for compile_blocks in (False,) if args.smoke else (False, True):
        s = _run(plan, args.steps, compile_blocks, backend)
        if s is None:
            continue
        achieved = flops_per_token * s["tokens_per_s"]
        mfu = f"{achieved / peak:.1%}" if peak else "-"
        print(f"{'compiled' if compile_blocks else 'eager':<10}{s['step_time_s']:>10.3f}{s['tokens_per_s']:>12.0f}"
              f"{achieved / 1e12:>10.1f}{mfu:>8}{s['ranks'][0]['peak_memory_bytes'] / 2**30:>10.1f}{s['final_loss']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
