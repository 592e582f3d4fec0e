"""Defence in depth against absurd predictions (issue 19).

A spec can pass its schema and still hold a value (a latency of 1e308 us, a bandwidth of 1e-300
GB/s) that turns a prediction into inf or NaN. Nothing non-finite may reach a table, a JSON file or
a CI verdict: `require_finite` turns such a prediction into one user error that names the input
most likely to blame (the most extreme value among the inputs of the term that broke).
"""
from __future__ import annotations

import math

import numpy as np

from plan3d.errors import NonFinitePrediction
from plan3d.vocab import term_of_column

# typical magnitudes, to rank how extreme a value is (|log10(value / typical)|)
TYPICAL = {"latency_us": 10.0, "bandwidth_gbytes_per_s": 100.0, "efficiency": 0.8, "peak_tflops": 100.0,
           "hbm_tbytes_per_s": 2.0, "memory_gib": 80.0, "reserved_memory_gib": 2.0, "max_fraction": 0.7,
           "half_work_flops": 2e9, "elementwise_bytes": 8.0, "attention_score_bytes": 2.0,
           "layer_overhead_s": 1e-4, "micro_batch_overhead_s": 1e-3}
EXTREME = 6.0  # orders of magnitude from the typical value that make an input the suspect


NON_NEGATIVE = ("step_time_s", "tokens_per_s", "peak_memory_bytes", "capacity_bytes")
# A step longer than 30,000 years is no training plan but a unit error, whatever the hardware
# (the slowest bundled case, Llama-3 405B on the 8-core local-cpu spec, predicts 4e8 s).
MAX_STEP_S = 1e12


def is_finite(values, non_negative: bool = False) -> bool:
    """True when every value is finite (and, with `non_negative`, not below zero)."""
    a = np.asarray(values, dtype=np.float64)
    return bool(np.isfinite(a).all() and (not non_negative or (a >= 0).all()))


def require_finite(metrics: dict, cluster, model, training, engine=None) -> None:
    """Raise NonFinitePrediction when a metric (arrays, scalars, lists; nested dicts such as
    `time_s` are looked into) is NaN or infinite, or a time, rate or memory is negative."""
    flat = _flat(metrics)
    bad = [k for k, v in flat.items() if not is_finite(v, k in NON_NEGATIVE)]
    if bad:
        terms = [term_of_column(k) for k in bad if term_of_column(k)]
        problem = f"a non-finite {terms[0].replace('_', ' ') + ' time' if terms else 'step time'}"
    elif "step_time_s" in flat and np.max(flat["step_time_s"], initial=0.0) > MAX_STEP_S:
        problem = f"a step time above {MAX_STEP_S:g} s"
    else:
        return
    raise NonFinitePrediction(nonfinite_message(problem, cluster, model, training, engine))


def _flat(metrics: dict) -> dict:
    """Numeric entries by name; a nested dict's keys get the parent's unit ("time_s" -> "_s")."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            unit = "_" + key.rsplit("_", 1)[-1]
            out.update(_flat({k if k.endswith(unit) else k + unit: v for k, v in value.items()}))
        elif isinstance(value, (bool, np.bool_)) or (isinstance(value, np.ndarray) and value.dtype == bool):
            continue
        elif isinstance(value, (int, float, list, np.ndarray, np.floating, np.integer)):
            out[key] = value
    return out


def nonfinite_message(problem: str, cluster, model, training, engine=None) -> str:
    """One line naming the input most likely to blame for `problem` ("a non-finite step time")
    and what to change."""
    suspects = network_inputs(cluster) + gpu_inputs(cluster, training)
    if engine is not None:
        suspects += [(f"engine {engine.name}: {k}", k, v) for k, v in engine.software_values().items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)]
    label, value = _most_extreme(suspects)
    if label is None:
        return (f"cluster {cluster.name}, model {model.name}, global batch {training.global_batch}: the specs give "
                f"{problem}; check them for extreme values")
    return f"{label} {value:g} gives {problem}; use a physical value (typical: {_typical_text(label)})"


def network_inputs(cluster) -> list[tuple[str, str, float]]:
    """(label, kind, value) of every tier's values as the cost model reads them (ClusterSpec.tiers)."""
    out = []
    for tier in cluster.tiers():
        where = f"cluster {cluster.name}: network tier {tier.name!r}"
        out += [(f"{where} latency_us", "latency_us", tier.latency_s * 1e6),
                (f"{where} bandwidth (GB/s per GPU)", "bandwidth_gbytes_per_s", tier.bandwidth_bytes_per_s / 1e9),
                (f"{where} efficiency", "efficiency", tier.efficiency)]
        for op, latency_s, efficiency in tier.collectives:
            out += [(f"{where} collectives.{op}.latency_us", "latency_us", latency_s * 1e6),
                    (f"{where} collectives.{op}.efficiency", "efficiency", efficiency)]
    return out


def gpu_inputs(cluster, training) -> list[tuple[str, str, float]]:
    gpu = cluster.gpu
    where = f"cluster {cluster.name}: gpu {gpu.name}"
    out = [(f"{where} peak_tflops", "peak_tflops", gpu.peak_flops(training.precision) / 1e12),
           (f"{where} hbm_tbytes_per_s", "hbm_tbytes_per_s", gpu.hbm_tbytes_per_s),
           (f"{where} memory_gib", "memory_gib", gpu.memory_gib),
           (f"{where} reserved_memory_gib", "reserved_memory_gib", gpu.reserved_memory_gib)]
    eff = gpu.compute_efficiency
    out += [(f"{where} compute_efficiency.{k}", k, getattr(eff, k)) for k in TYPICAL if hasattr(eff, k)]
    return out


def _most_extreme(suspects) -> tuple[str | None, float]:
    best, best_score = (None, 0.0), EXTREME
    for label, kind, value in suspects:
        typical = TYPICAL.get(kind)
        if typical is None or not isinstance(value, (int, float)) or value == 0:
            continue
        score = math.inf if not math.isfinite(value) else abs(math.log10(abs(value) / typical))
        if score >= best_score:
            best, best_score = (label, value), score
    return best


def _typical_text(label: str) -> str:
    kind = next((k for k in TYPICAL if label.endswith(k) or k in label), None)
    if "bandwidth" in label:
        kind = "bandwidth_gbytes_per_s"
    return f"about {TYPICAL[kind]:g}" if kind else "see docs/specs.md"
