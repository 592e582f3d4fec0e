"""Calibration: raw micro-benchmark measurements -> fitted compute efficiency and network tiers.

Pure functions (no torch, no I/O besides `write_calibrated_spec`). The measurements come from
`plan3d.runtime.calibrate_worker` (GEMMs and collectives) or from a launch's run directory
(`refit_from_runs`).

Compute: the GPU spec's curve eff(w) = max_fraction * w / (w + half_work_flops) (see
`plan3d.specs.gpu.ComputeEfficiency`), w = FLOPs of one GEMM. Its reciprocal is linear in 1/w,

    peak * t / flops = 1 / eff = 1 / max_fraction + (half_work_flops / max_fraction) * (1 / w),

so the fit is a weighted linear least squares (weights 1/y: relative error) of y = peak*t/flops on
x = 1/w (the Lineweaver-Burk form of a saturating curve).

Network: the alpha-beta model of cost-model.md (Thakur, Rabenseifner and Gropp 2005, ring
algorithms): all-reduce 2(n-1)/n * S/bw + 2(n-1)*alpha; all-gather and reduce-scatter
(n-1)/n * S/bw + (n-1)*alpha; point-to-point S/bw + alpha. Each sample gives a row
(volume_bytes, hops) and t = volume/bw + hops*alpha is fitted per tier, again by relative least
squares with both unknowns kept non-negative.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from plan3d.cost.comm import RING_TERMS
from plan3d.errors import Plan3dError, SpecError
from plan3d.rankmap import innermost_tier
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.gpu import ComputeEfficiency
from plan3d.vocab import COLLECTIVE_KINDS, RING_COLLECTIVES

MEASUREMENTS_SUFFIX = ".measurements.json"


@dataclass(frozen=True)
class ComputeFit:
    efficiency: ComputeEfficiency
    peak_flops: float  # the peak the efficiency refers to (raised when the catalog peak was exceeded)
    max_rel_error: float  # worst |fitted - measured| / measured over the samples
    samples: int
    rms_rel_error: float = 0.0  # root mean square of (fitted - measured) / measured


@dataclass(frozen=True)
class TierFit:
    tier_index: int
    bandwidth_bytes_per_s: float  # effective (achieved) per-GPU, one direction
    latency_s: float
    max_rel_error: float
    samples: int
    rms_rel_error: float = 0.0


def relative_errors(predicted, measured) -> tuple[float, float]:
    """(worst, root mean square) of (predicted - measured) / measured."""
    rel = (np.asarray(predicted, dtype=float) - np.asarray(measured, dtype=float)) / np.asarray(measured, dtype=float)
    return float(np.max(np.abs(rel))), float(np.sqrt(np.mean(rel**2)))


# ---- compute ---------------------------------------------------------------------------------
def fit_compute_efficiency(gemms: list[dict], peak_flops: float) -> ComputeFit:
    """Fit eff(w) to GEMM samples {'flops', 'time_s'}; `peak_flops` is the catalog peak."""
    if len(gemms) < 2:
        raise SpecError("calibration", ["need at least two GEMM samples to fit the efficiency curve"])
    work = np.array([g["flops"] for g in gemms], dtype=float)
    time_s = np.array([g["time_s"] for g in gemms], dtype=float)
    y = peak_flops * time_s / work
    a, b = _nonneg_relative_lstsq(np.stack([np.ones_like(work), 1.0 / work], axis=1), y)
    a = a if a > 0 else float(y.min())
    max_fraction, half_work = 1.0 / a, b / a
    peak = peak_flops
    if max_fraction > 1.0:  # the catalog peak is too low for this machine: move the peak, not the cap
        peak, max_fraction = peak_flops * max_fraction, 1.0
    eff = ComputeEfficiency(max_fraction=max_fraction, half_work_flops=half_work)
    predicted = work / (peak * efficiency_at(eff, work))
    worst, rms = relative_errors(predicted, time_s)
    return ComputeFit(eff, peak, worst, len(gemms), rms)


def efficiency_at(eff: ComputeEfficiency, work_flops):
    return eff.max_fraction * work_flops / (work_flops + eff.half_work_flops)


def fit_memory_bandwidth(samples: list[dict]) -> tuple[float, float]:
    """Effective memory bandwidth (bytes/s) from memory-bound kernels {'bytes', 'time_s'}:
    t = bytes / bw, relative least squares; returns (bw, worst relative error)."""
    ratio = np.array([s["bytes"] / s["time_s"] for s in samples], dtype=float)
    inv_bw = float(ratio.sum() / (ratio @ ratio))
    return 1.0 / inv_bw, float(np.max(np.abs(ratio * inv_bw - 1.0)))


# ---- network ----------------------------------------------------------------------------------
def collective_terms(op: str, n: int, size_bytes: float) -> tuple[float, float]:
    """(bytes on the wire per GPU, latency hops) of one collective: the ring terms the cost model
    prices (`plan3d.cost.comm.RING_TERMS`), so a fit and a prediction read the same volumes."""
    if op not in RING_TERMS:
        raise ValueError(f"unknown collective {op!r}")
    return RING_TERMS[op](size_bytes, n)


def fit_tier(samples: list[dict], tier_index: int) -> TierFit:
    """Fit the tier's own bandwidth and latency to samples {'op', 'group_size', 'bytes', 'time_s'}:
    the all-reduce samples when there are any (the collective most traffic uses), else all the
    collectives pooled. Each kind also gets its own fit (`fit_ops`), written where it differs."""
    all_reduce = [s for s in samples if s["op"] == "all_reduce"]
    collective = [s for s in samples if s["op"] in RING_COLLECTIVES]
    return _fit_alpha_beta(all_reduce or collective or samples, tier_index)


def fit_ops(samples: list[dict], tier_index: int) -> dict[str, TierFit]:
    """An alpha-beta fit per collective kind (gloo's reduce-scatter, for one, costs about an
    all-reduce, twice a ring reduce-scatter; point-to-point takes its own path)."""
    kinds = sorted({s["op"] for s in samples})
    return {op: _fit_alpha_beta([s for s in samples if s["op"] == op], tier_index) for op in kinds}


def _fit_alpha_beta(samples: list[dict], tier_index: int) -> TierFit:
    rows = np.array([collective_terms(s["op"], s["group_size"], s["bytes"]) for s in samples], dtype=float)
    time_s = np.array([s["time_s"] for s in samples], dtype=float)
    inv_bw, alpha = _nonneg_relative_lstsq(rows, time_s)
    inv_bw = inv_bw if inv_bw > 0 else float(np.min(time_s / rows[:, 0]))
    predicted = rows @ np.array([inv_bw, alpha])
    worst, rms = relative_errors(predicted, time_s)
    return TierFit(tier_index, 1.0 / inv_bw, alpha, worst, len(samples), rms)


def _nonneg_relative_lstsq(design: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """Two non-negative coefficients minimising the sum of squared relative errors."""
    weighted, rhs = design / target[:, None], np.ones_like(target)
    coef = np.linalg.lstsq(weighted, rhs, rcond=None)[0]
    if (coef >= 0).all():
        return float(coef[0]), float(coef[1])
    best = None
    for keep in (0, 1):  # one coefficient pinned at zero: a 1-D least squares on the other
        column = weighted[:, keep]
        value = max(float(column @ rhs / (column @ column)), 0.0)
        residual = float(np.sum((column * value - rhs) ** 2))
        if best is None or residual < best[0]:
            best = (residual, keep, value)
    out = [0.0, 0.0]
    out[best[1]] = best[2]
    return out[0], out[1]


# ---- the calibrated spec ----------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationFit:
    compute: ComputeFit
    tiers: list[TierFit]
    memory_bytes_per_s: float | None = None
    memory_max_rel_error: float | None = None
    layer_overhead_s: float | None = None
    dtype: str = "bf16"
    device: str = "cuda"
    ops: dict = field(default_factory=dict)  # tier index -> {op: TierFit}
    cpu_cores: int | None = None  # cores the ranks of this machine shared (CPU runs)
    memory_rms_rel_error: float | None = None


# ---- how good each fit is ----------------------------------------------------------------------
GOOD_RMS, USABLE_RMS = 0.15, 0.5  # relative RMS error of a fit: good below 15%, unusable above 50%


def fit_quality(fit: CalibrationFit, tier_names: list[str]) -> list[dict[str, Any]]:
    """One row per fitted term: its relative RMS and worst errors, the samples, and a verdict
    (good, poor, unusable); a coefficient the non-negative fit pinned at zero is said."""
    rows = [_quality("compute", "GEMM efficiency curve", fit.compute.rms_rel_error, fit.compute.max_rel_error,
                     fit.compute.samples)]
    if fit.memory_bytes_per_s is not None:
        rows.append(_quality("memory", "elementwise bandwidth", fit.memory_rms_rel_error or 0.0,
                             fit.memory_max_rel_error or 0.0, None))
    for index, ops in sorted(fit.ops.items()):
        for op, op_fit in sorted(ops.items()):
            pinned = " (latency pinned at 0: the samples asked for a negative one)" if op_fit.latency_s == 0 else ""
            rows.append(_quality(tier_names[index], f"{op} bandwidth and latency{pinned}", op_fit.rms_rel_error,
                                 op_fit.max_rel_error, op_fit.samples))
    return rows


def _quality(scope: str, term: str, rms: float, worst: float, samples: int | None) -> dict[str, Any]:
    verdict = "good" if rms <= GOOD_RMS else "poor" if rms <= USABLE_RMS else "unusable"
    return {"scope": scope, "term": term, "rms_rel_error": rms, "max_rel_error": worst, "samples": samples,
            "verdict": verdict}


def unusable_fits(quality: list[dict[str, Any]]) -> list[str]:
    """One line per unusable fit, for the warning and the spec's header."""
    return [f"{q['scope']} {q['term']}: relative RMS error {q['rms_rel_error']:.0%} (worst {q['max_rel_error']:.0%})"
            for q in quality if q["verdict"] == "unusable"]


def fit_measurements(cluster: ClusterSpec, raw: dict, dtype: str) -> CalibrationFit:
    """Every fit the raw record allows: compute always, memory and tiers when measured."""
    compute = fit_compute_efficiency(raw["gemm"], cluster.gpu.peak_flops(dtype))
    by_tier: dict[int, list[dict]] = {}
    for sample in raw.get("collectives", []):
        by_tier.setdefault(sample["tier"], []).append(sample)
    tiers = [fit_tier(samples, index) for index, samples in sorted(by_tier.items())]
    ops = {index: fit_ops(samples, index) for index, samples in sorted(by_tier.items())}
    memory = fit_memory_bandwidth(raw["elementwise"]) if raw.get("elementwise") else (None, None)
    return CalibrationFit(compute, tiers, *memory, layer_overhead_s=layer_overhead(raw.get("layer_overhead")),
                          dtype=dtype, device=raw.get("device", "cuda"), ops=ops,
                          cpu_cores=raw.get("cpu_cores"),
                          memory_rms_rel_error=memory_rms_error(raw["elementwise"], memory[0])
                          if raw.get("elementwise") else None)


def memory_rms_error(samples: list[dict], bytes_per_s: float) -> float:
    """Relative RMS error of t = bytes / bw over the memory-bound samples."""
    predicted = [s["bytes"] / bytes_per_s for s in samples]
    return relative_errors(predicted, [s["time_s"] for s in samples])[1]


def layer_overhead(probe: dict | None) -> float | None:
    """Per-layer fixed cost of one forward pass from the probe's forward + backward time: the
    cost model counts it once per forward and twice per backward (ComputeEfficiency docstring)."""
    if not probe or "layer_overhead_s" not in ComputeEfficiency.model_fields:
        return None
    return probe["forward_backward_s"] / 3


def calibrated_cluster(cluster: ClusterSpec, fit: CalibrationFit, source: str, machine: str | None = None) -> ClusterSpec:
    """`cluster` with the fitted efficiency (and peak, if raised), memory bandwidth and tiers,
    named after `cluster`, the machine measured (default: this one) and the day."""
    machine = machine or this_machine()
    compute, tiers = fit.compute, fit.tiers
    data = cluster.model_dump()
    gpu = data["gpu"]
    gpu["compute_efficiency"] = {**gpu["compute_efficiency"], **compute.efficiency.model_dump(
        include={"max_fraction", "half_work_flops"})}
    if fit.memory_bytes_per_s is not None:
        gpu["hbm_tbytes_per_s"] = fit.memory_bytes_per_s / 1e12
    if fit.layer_overhead_s is not None:
        gpu["compute_efficiency"]["layer_overhead_s"] = fit.layer_overhead_s
    if fit.device == "cpu" and "dp_overlap_fraction" in gpu["compute_efficiency"]:
        # gloo reduces on the same cores that compute: nothing of the gradient reduction hides.
        gpu["compute_efficiency"]["dp_overlap_fraction"] = 0.0
    if fit.device == "cpu" and "host_overlap" in gpu["compute_efficiency"]:
        gpu["compute_efficiency"]["host_overlap"] = False  # the same core dispatches and computes
    if fit.device == "cpu" and fit.cpu_cores:
        data["cpu_cores_per_node"] = fit.cpu_cores  # the rates above hold with every rank busy
    gpu["compute_efficiency"]["fitted_on"] = fitted_on("plan3d calibrate")
    scale = compute.peak_flops / cluster.gpu.peak_flops(fit.dtype)
    if not math.isclose(scale, 1.0):
        gpu["peak_tflops"] = {k: v * scale for k, v in gpu["peak_tflops"].items()}
        gpu["source"] = f"{gpu.get('source', '')}; peak raised x{scale:.2f} by calibration".lstrip("; ")
    resolved = cluster.tiers()
    for tier_fit in tiers:
        index = tier_fit.tier_index
        data["network"][index] = _fitted_tier(data["network"][index], resolved[index], tier_fit,
                                              fit.ops.get(index, {}))
    data["source"] = source
    data["name"] = calibrated_name(cluster.name, machine)
    data["description"] = f"{cluster.name} calibrated on {machine} on {datetime.date.today().isoformat()}"
    return ClusterSpec.model_validate(data)


def this_machine() -> str:
    """The host name (lower case, letters, digits and dashes), for a calibrated spec's name."""

    return re.sub(r"[^a-z0-9-]+", "-", platform.node().lower()).strip("-")[:40] or "unknown-host"


def calibrated_name(base: str, machine: str) -> str:
    """`local-cpu-calibrated-HOST-20250101`: never the bundled spec's own name (a spec calibrated
    before keeps its base name, not a chain of suffixes)."""

    base = re.sub(r"-calibrated-.*$", "", base)
    machine = re.sub(r"[^A-Za-z0-9._-]+", "-", machine).strip("-.") or "host"  # a spec name is one plain word
    return f"{base}-calibrated-{machine}-{datetime.date.today():%Y%m%d}"


def fitted_on(how: str) -> str:
    """`compute_efficiency.fitted_on` of a spec written by calibration: how, and the day."""
    return f"{how}, {datetime.date.today().isoformat()}"


def stamped(cluster: ClusterSpec, how: str, machine: str | None = None) -> ClusterSpec:
    """`cluster` whose GPU efficiency says it was fitted by `how` today (see `plan3d.cost.trust`),
    renamed after the machine and the day (`calibrated_name`)."""
    machine = machine or this_machine()
    data = cluster.model_dump()
    data["gpu"]["compute_efficiency"]["fitted_on"] = fitted_on(how)
    data["name"] = calibrated_name(cluster.name, machine)
    data["description"] = f"{cluster.name} refitted on {machine} on {datetime.date.today().isoformat()}"
    return ClusterSpec.model_validate(data)


def _fitted_tier(tier: dict, resolved, fit: TierFit, ops: dict[str, TierFit]) -> dict:
    """Keep the catalog bandwidth and fit the efficiency; if the catalog is beaten, take the
    measurement. Every other measured collective kind gets its own (latency, efficiency)."""
    tier = dict(tier)
    bandwidth = resolved.bandwidth_bytes_per_s
    efficiency = fit.bandwidth_bytes_per_s / bandwidth
    if efficiency > 1.0:
        tier["bandwidth"] = {"gbytes_per_s_per_gpu": fit.bandwidth_bytes_per_s / 1e9}
        tier["oversubscription"], efficiency, bandwidth = 1.0, 1.0, fit.bandwidth_bytes_per_s
    tier["efficiency"] = efficiency
    tier["latency_us"] = fit.latency_s * 1e6
    tier["collectives"] = {op: {"latency_us": f.latency_s * 1e6,
                                "efficiency": min(1.0, f.bandwidth_bytes_per_s / bandwidth)}
                           for op, f in ops.items() if op != "all_reduce"}
    return tier


def summary_rows(before: ClusterSpec, after: ClusterSpec, fit: CalibrationFit, dtype: str) -> list[dict[str, Any]]:
    """Fitted against catalog values, SI units: one row per quantity."""
    compute, tiers = fit.compute, fit.tiers
    b_eff, a_eff = before.gpu.compute_efficiency, after.gpu.compute_efficiency
    rows = [
        row("compute", "peak FLOP/s", before.gpu.peak_flops(dtype), after.gpu.peak_flops(dtype), "flops_per_s"),
        row("compute", "max fraction of peak", b_eff.max_fraction, a_eff.max_fraction, "ratio"),
        row("compute", "half-efficiency GEMM FLOPs", b_eff.half_work_flops, a_eff.half_work_flops, "flops"),
        row("compute", "worst GEMM fit error", None, compute.max_rel_error, "ratio"),
        row("compute", "GEMM fit relative RMS error", None, compute.rms_rel_error, "ratio"),
    ]
    if fit.layer_overhead_s is not None:
        rows.append(row("compute", "per-layer overhead (forward)", getattr(b_eff, "layer_overhead_s", None),
                        fit.layer_overhead_s, "s"))
    if fit.memory_bytes_per_s is not None:
        rows += [row("memory", "bandwidth", before.gpu.hbm_tbytes_per_s * 1e12, fit.memory_bytes_per_s, "bytes_per_s"),
                 row("memory", "worst elementwise fit error", None, fit.memory_max_rel_error, "ratio")]
    old, new = before.tiers(), after.tiers()
    for tier in tiers:
        name = new[tier.tier_index].name
        rows += [
            row(name, "effective bandwidth per GPU", old[tier.tier_index].effective_bytes_per_s,
                new[tier.tier_index].effective_bytes_per_s, "bytes_per_s"),
            row(name, "latency per hop", old[tier.tier_index].latency_s, new[tier.tier_index].latency_s, "s"),
            row(name, "worst collective fit error", None, tier.max_rel_error, "ratio"),
            row(name, "collective fit relative RMS error", None, tier.rms_rel_error, "ratio"),
        ]
    for index, ops in fit.ops.items():
        name, resolved = new[index].name, new[index]
        for op, op_fit in ops.items():
            if op == "all_reduce":
                continue
            bandwidth, latency = resolved.cost(op)
            rows += [row(name, f"{op} effective bandwidth", None, bandwidth, "bytes_per_s"),
                     row(name, f"{op} latency per hop", None, latency, "s"),
                     row(name, f"{op} worst fit error", None, op_fit.max_rel_error, "ratio"),
                     row(name, f"{op} fit relative RMS error", None, op_fit.rms_rel_error, "ratio")]
    return rows


def row(scope: str, quantity: str, catalog, fitted, unit: str) -> dict[str, Any]:
    return {"scope": scope, "quantity": quantity, "catalog": catalog, "fitted": fitted, "unit": unit}


def write_calibrated_spec(cluster: ClusterSpec, raw: dict, path: Path, warnings: list[str] = ()) -> Path:
    """Write the spec (YAML) and the raw measurements beside it; return the measurements' path.
    `warnings` (unusable fits) head the file, one `# WARNING:` comment each."""


    measurements = path.with_name(path.name + MEASUREMENTS_SUFFIX)
    header = (f"# Written by `plan3d calibrate`; raw measurements in {measurements.name}.\n"
              "# Use it like any cluster spec: plan3d estimate --cluster THIS_FILE ...\n"
              + "".join(f"# WARNING: unusable fit, {w}\n" for w in warnings))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        measurements.write_text(json.dumps(raw, indent=1, allow_nan=False))
        path.write_text(header + yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True), sort_keys=False))
    except OSError as err:
        raise Plan3dError(f"cannot write {path} ({err.strerror}); choose another --out") from err
    return measurements


# ---- refit from real runs --------------------------------------------------------------------
Predictor = Callable[[ClusterSpec], list[float]]


OVERHEAD_KNOBS = ("layer_overhead_s", "micro_batch_overhead_s")


def refit_from_runs(cluster: ClusterSpec, predict: Predictor, measured_s: list[float],
                    fit_overhead: bool = False) -> tuple[ClusterSpec, dict]:
    """Refit the compute side so predicted step times best match measured ones.

    `predict(cluster)` returns the predicted step time of each run under `cluster`. Knobs: a
    multiplier k on the achieved FLOP/s (compute time goes as 1/k) and, when `fit_overhead`, the
    fixed times of `OVERHEAD_KNOBS` the GPU spec has (framework and launch costs that FLOPs do not
    see), one more knob per extra run: n runs fit at most n knobs. The overheads are off by
    default: on the CPU runs of docs/calibrate.md they soaked up communication the model does not
    count and made held-out predictions worse than the throughput multiplier alone. The loss is the mean squared
    log ratio of predicted to measured (robust to a mix of short and long steps), minimised by
    cyclic golden-section searches (log k in [1/50, 50], each overhead in [1e-7, 1] s on a log
    scale). Returns the refitted cluster and the fitted values.
    """
    measured = np.array(measured_s, dtype=float)
    fields = ComputeEfficiency.model_fields
    knobs = [k for k in OVERHEAD_KNOBS if k in fields][:max(0, len(measured) - 1)] if fit_overhead else []
    values = {"log_k": 0.0, **{k: getattr(cluster.gpu.compute_efficiency, k) for k in knobs}}

    def spec(v: dict) -> ClusterSpec:
        return with_overheads(scaled_compute(cluster, math.exp(v["log_k"])), {k: v[k] for k in knobs})

    def loss(v: dict) -> float:
        predicted = np.array(predict(spec(v)), dtype=float)
        return float(np.mean(np.log(predicted / measured) ** 2))

    for _ in range(4 if knobs else 1):
        values["log_k"] = _golden_min(lambda x: loss({**values, "log_k": x}), math.log(1 / 50), math.log(50))
        for knob in knobs:
            values[knob] = math.exp(_golden_min(lambda y: loss({**values, knob: math.exp(y)}),
                                                math.log(1e-7), math.log(1.0)))
    fitted = {"throughput_scale": math.exp(values["log_k"]), **{k: values[k] for k in knobs},
              "rms_log_error": math.sqrt(loss(values))}
    return spec(values), fitted


def with_overheads(cluster: ClusterSpec, overheads: dict[str, float]) -> ClusterSpec:
    if not overheads:
        return cluster
    data = cluster.model_dump()
    data["gpu"]["compute_efficiency"].update(overheads)
    return ClusterSpec.model_validate(data)


def scaled_compute(cluster: ClusterSpec, k: float) -> ClusterSpec:
    """`cluster` whose achieved FLOP/s are k times larger (max_fraction capped at 1, peak takes the rest)."""
    data = cluster.model_dump()
    eff = data["gpu"]["compute_efficiency"]
    fraction = eff["max_fraction"] * k
    peak_scale = max(fraction, 1.0)
    eff["max_fraction"] = fraction / peak_scale
    data["gpu"]["peak_tflops"] = {d: v * peak_scale for d, v in data["gpu"]["peak_tflops"].items()}
    return ClusterSpec.model_validate(data)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iterations: int = 40) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(iterations):
        if f1 < f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - ratio * (hi - lo)
            f1 = f(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + ratio * (hi - lo)
            f2 = f(x2)
    return (lo + hi) / 2


# ---- the sweep to run -------------------------------------------------------------------------
def layer_gemms(model, seq_len: int, tp: int, micro_batch: int) -> list[dict]:
    """The GEMMs of one transformer layer's forward pass on one rank (Megatron-style TP split).

    QKV and fc1 are column-parallel (output / tp), out-projection and fc2 row-parallel (input / tp),
    attention scores and context are batched over the rank's heads (heads / tp)."""
    h, d, heads = model.hidden, model.head_dim_, model.heads
    tokens = micro_batch * seq_len
    up = model.ffn_hidden_ * (2 if model.activation == "swiglu" else 1)
    tag = f"tp{tp} mb{micro_batch}"
    shapes = [
        ("qkv", 1, tokens, h, (heads + 2 * model.kv_heads_) * d // tp),
        ("attn_out", 1, tokens, heads * d // tp, h),
        ("fc1", 1, tokens, h, up // tp),
        ("fc2", 1, tokens, model.ffn_hidden_ // tp, h),
        ("scores", micro_batch * heads // tp, seq_len, d, seq_len),
        ("context", micro_batch * heads // tp, seq_len, seq_len, d),
    ]
    return [{"label": f"{name} {tag}", "batch": b, "m": m, "k": k, "n": n} for name, b, m, k, n in shapes]


def collective_groups(cluster: ClusterSpec, world_size: int) -> list[dict]:
    """Concurrent disjoint groups to measure: powers of two inside a node, and one rank per node."""
    g, nodes = min(cluster.gpus_per_node, world_size), max(1, world_size // cluster.gpus_per_node)
    kinds, n = [], 2
    while n <= g:
        kinds.append([list(range(start, start + n)) for start in range(0, nodes * g, n)])
        n *= 2
    if nodes > 1:
        kinds.append([[node * g + r for node in range(nodes)] for r in range(g)])
    tiers = cluster.tiers()
    return [{"tier": innermost_tier(members, tiers), "members": members} for members in kinds]


def message_sizes(max_bytes: int, min_bytes: int = 4096) -> list[int]:
    """Collective message sizes: powers of four from `min_bytes` up to `max_bytes`."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes or [max_bytes]


def overhead_probe(model) -> dict:
    """A one-layer copy of `model`'s structure (norm, activation, position, bias, GQA) with tiny
    shapes (hidden 32, 8 tokens): its forward + backward time is the fixed per-layer cost."""
    heads = 2
    kv = 1 if model.kv_heads_ < model.heads else None
    probe = {"name": "overhead-probe", "layers": 1, "hidden": 32, "heads": heads, "kv_heads": kv,
             "activation": model.activation, "norm": model.norm, "bias": model.bias,
             "position": model.position, "vocab": 64, "seq_len": 8}
    return {"model": {k: v for k, v in probe.items() if v is not None}, "micro_batch": 1}


def sweep_config(cluster: ClusterSpec, model, seq_len: int, world_size: int, device: str,
                 tps: list[int], micro_batches: list[int], sizes_bytes: list[int], repeats: int,
                 ops: tuple[str, ...] = COLLECTIVE_KINDS) -> dict:
    """Everything the worker needs, as plain JSON."""
    gemms = [g for tp in tps if model.heads % tp == 0 and model.kv_heads_ % tp == 0
             for mb in micro_batches for g in layer_gemms(model, seq_len, tp, mb)]
    elementwise = sorted({g["m"] * g["n"] for g in gemms if g["batch"] == 1})
    return {"device": device, "torch_dtype": "float32" if device == "cpu" else "bfloat16",
            "gemms": gemms, "elementwise": elementwise, "overhead_probe": overhead_probe(model), "groups": collective_groups(cluster, world_size), "ops": list(ops),
            "sizes_bytes": sizes_bytes, "repeats": repeats, "in_step": True}
