"""Predicted BF16 vs FP8 step times on Hopper (issue 16, FP8): what the FP8 time model says, next
to what NVIDIA has published for FP8 runs.

Each row estimates one layout twice with the default engine (megatron-core), `--precision bf16`
and `--precision fp8`, and prints both step times, the speed-up, the model TFLOP/s per GPU and
whether the layout fits. The FP8 model (docs/cost-model.md, FP8): the linear-layer GEMMs at the
fp8 peak at `fp8_gemm_fraction` of the bf16 curve (Hopper 0.73, fitted by published.py on the
published pairs' speed-ups), attention, norms,
embedding and output layer in bf16, plus the cast traffic of every FP8 GEMM input and output
gradient.

No published figure is printed here: the FP8 runs that check this model are the held-out FP8
rows of `benchmarks/data/extra_runs.yaml`, predicted by `benchmarks/published.py` (their absolute
times never fitted; the pairs' speed-up ratios fit the Hopper fraction).
NVIDIA's NeMo / Megatron-Bridge performance summaries are reserved for acceptance testing
(../shared/data/published/README.md) and are not used.

    .venv/bin/python benchmarks/fp8_speedup.py
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.cost.estimate import estimate
from plan3d.layout import Layout
from plan3d.specs.catalog import engine_for, load_cluster, load_model
from plan3d.specs.training import TrainingSpec

@dataclass(frozen=True)
class Row:
    label: str
    cluster: str
    nodes: int
    model: str
    global_batch: int
    seq_len: int | None
    layout: dict


ROWS = [
    Row("Llama-3 70B, 64 H100, tp8 pp1 (the brief's example)", "dgx-h100", 8, "llama3-70b", 128, 8192,
        dict(tp=8, pp=1, dp=8, zero=1, sequence_parallel=True, recompute="full")),
    Row("Llama-3 70B, 64 H100, tp4 pp4 vpp5", "dgx-h100", 8, "llama3-70b", 128, 8192,
        dict(tp=4, pp=4, dp=4, vpp=5, zero=1, sequence_parallel=True)),
    Row("Llama-3 405B, 112 H100, tp8 pp7 vpp2", "dgx-h100", 14, "llama3-405b", 56, 8192,
        dict(tp=8, pp=7, dp=2, vpp=2, zero=1, sequence_parallel=True, recompute="full")),
    Row("GPT-3 175B, 512 H100, tp4 pp8 vpp6 mb2", "dgx-h100", 64, "gpt3-175b", 2048, 2048,
        dict(tp=4, pp=8, dp=16, vpp=6, micro_batch=2, zero=1, sequence_parallel=True)),
    Row("Llama-3 8B, 8 H100, dp8", "dgx-h100", 1, "llama3-8b", 128, 8192,
        dict(dp=8, zero=1)),
    Row("Llama-3 70B, 64 H200, tp4 pp4 vpp5", "h200", 8, "llama3-70b", 128, 8192,
        dict(tp=4, pp=4, dp=4, vpp=5, zero=1, sequence_parallel=True)),
]


def predict(row: Row, precision: str):
    cluster = load_cluster(row.cluster, nodes=row.nodes)
    training = TrainingSpec(global_batch=row.global_batch, seq_len=row.seq_len, precision=precision)
    return estimate(cluster, load_model(row.model), training, Layout(**row.layout), engine_for(None, cluster))


def table_lines() -> list[str]:
    head = f"{'layout':58} {'bf16 s':>8} {'fp8 s':>8} {'x':>5} {'bf16 TF':>8} {'fp8 TF':>7} fits"
    lines = [head, "-" * len(head)]
    for row in ROWS:
        bf16, fp8 = predict(row, "bf16"), predict(row, "fp8")
        lines.append(f"{row.label:58} {bf16.step_time_s:8.2f} {fp8.step_time_s:8.2f} "
                     f"{bf16.step_time_s / fp8.step_time_s:5.2f} {bf16.model_tflops_per_gpu:8.0f} "
                     f"{fp8.model_tflops_per_gpu:7.0f} {'yes' if fp8.fits else 'no'}")
    lines.append("measured FP8 runs (held out; their speed-ups fit the Hopper fraction): benchmarks/published.py, held-out section")
    return lines


if __name__ == "__main__":
    print("\n".join(table_lines()))
