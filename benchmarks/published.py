"""How well plan3d predicts published training runs it was (or was not) fitted to.

    .venv/bin/python benchmarks/published.py             # per-run and per-source table, bundled values
    .venv/bin/python benchmarks/published.py --loso      # + leave-one-source-out (refits without each source)
    .venv/bin/python benchmarks/published.py --fit       # fit the global values on every source, print them
    .venv/bin/python benchmarks/published.py --json      # the same figures for machines
    .venv/bin/python benchmarks/published.py --no-held-out   # without the held-out section

Held-out validation (appended after everything else): the published MoE, FP8 and
context-parallel runs of data/extra_runs.yaml (data/README.md) are predicted with the values in
use (bundled, or fitted with --fit) and never enter a fit, leave-one-source-out included. They
are printed per source (measured vs predicted step time), with a summary line, the FP8/BF16 pairs
and the rows plan3d cannot predict yet, each with its reason (a layout it cannot express, a GPU
without a cluster spec, MoE layers that estimate() still models as dense).

Every run of ../shared/data/published/runs.yaml with a step time (published_runs.py says how
each is read) is predicted with `estimate` on the bundled cluster of its GPU, with the engine
profile of the software that ran it. The fitted values are few and global (FIT_KEYS: the GEMM
ceiling of each GPU generation, the attention-score traffic of unfused softmax engines, the
host overhead of each engine family); no value belongs to a run, a model or a source. The fit
minimises the mean over sources of each source's MAPE, so that one large source does not
outweigh the others.

Leave-one-source-out: for each source, the values are fitted on all other sources and the left
out one is predicted. A value that no remaining source informs (the only H100 source left out)
keeps its bundled prior (the GPU spec's datasheet default).

Orderings: within each group of runs a source compares directly (same model, GPU count and
global batch: Narayanan's PTD-P vs ZeRO-3, Korthikanti's selective + SP vs full recompute, the
BLOOM topology grids), every pair whose measured times differ by more than 10% is counted
right when the prediction orders it the same way.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from functools import lru_cache
from itertools import combinations, product
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fitting import nelder_mead  # noqa: E402
from published_runs import DATA, EXTRA, FRAMEWORK_CHANGES, Run, load, load_extra  # noqa: E402

import yaml  # noqa: E402

from plan3d.cost.bands import BAND_FILE, REGION_FIELDS, BandData, MeasuredRun, Region, band_of, load_band_data, sharded_stages, without_source  # noqa: E402
from plan3d.cost.estimate import estimate  # noqa: E402
from plan3d.cost.context import MOE_IMBALANCE  # noqa: E402
from plan3d.errors import LayoutError  # noqa: E402
from plan3d.layout import Layout  # noqa: E402
from plan3d.specs.catalog import bundled_names, load_cluster, load_engine  # noqa: E402

# name -> (what it sets, where); GPU generations by GPU spec names, engines by engine names
LEGACY = ("megatron-lm-2021", "deepspeed", "megatron-deepspeed")  # Megatron's 2020-2022 GPT model code
HOPPER = ("h100-sxm", "h100-nvl", "h200", "h800", "gh200")
FIT_KEYS = {
    "a100.max_fraction": ("gpu", ("a100-80gb", "a100-40gb"), "max_fraction"),
    "unfused.attention_score_bytes": ("engine", LEGACY, "attention_score_bytes"),
    "legacy.layer_overhead_s": ("engine", LEGACY, "layer_overhead_s"),
    "megatron-deepspeed.gemm_efficiency_scale": ("engine", ("megatron-deepspeed",), "gemm_efficiency_scale"),
    "megatron-core.elementwise_bytes": ("engine", ("megatron-core",), "elementwise_bytes"),
    "megatron-core.gemm_efficiency_scale": ("engine", ("megatron-core",), "gemm_efficiency_scale"),
    "a100.nvlink_latency_us": ("tier", ("dgx-a100-80g", "dgx-a100-40g"), "latency_us"),
    "deepspeed-0.19.zero3_overlap_fraction": ("runs_as", ("deepspeed-0.19",), "zero3_overlap_fraction"),
    "deepspeed-0.19.gemm_efficiency_scale": ("engine", ("deepspeed-0.19",), "gemm_efficiency_scale"),
    "hopper.fp8_gemm_fraction": ("gpu", HOPPER, "fp8_gemm_fraction"),  # fitted on the fp8/bf16 pairs only
}
SCALE = {"a100.max_fraction": 1.0, "a100.nvlink_latency_us": 10.0, "megatron-core.gemm_efficiency_scale": 1.0, "unfused.attention_score_bytes": 10.0,
         "legacy.layer_overhead_s": 1e-3, "megatron-deepspeed.gemm_efficiency_scale": 1.0,
         "megatron-core.elementwise_bytes": 1.0, "deepspeed-0.19.zero3_overlap_fraction": 1.0,
         "deepspeed-0.19.gemm_efficiency_scale": 1.0, "hopper.fp8_gemm_fraction": 1.0}
BOUNDS = {"a100.max_fraction": (0.3, 1.0), "a100.nvlink_latency_us": (0.5, 50.0), "megatron-core.gemm_efficiency_scale": (0.3, 1.0),
          "unfused.attention_score_bytes": (0.0, 100.0), "legacy.layer_overhead_s": (0.0, 5e-3),
          "megatron-deepspeed.gemm_efficiency_scale": (0.3, 1.0), "megatron-core.elementwise_bytes": (0.0, 64.0),
          "deepspeed-0.19.zero3_overlap_fraction": (0.0, 1.0), "deepspeed-0.19.gemm_efficiency_scale": (0.3, 1.0),
          "hopper.fp8_gemm_fraction": (0.4, 1.0)}
# Where each value starts, and what it keeps when no training run informs it (leave-one-source-out
# never starts from the bundled values, which were fitted on every source): the GPU spec's
# datasheet default for a GEMM ceiling, the vTrain fit (another data set) for the legacy Megatron
# software, no slowdown for an engine, and the HBM traffic counted from the kernels of a fused
# Megatron-Core layer (about 4 bytes per element, docs/cost-model.md).
PRIORS = {"a100.max_fraction": 0.75, "a100.nvlink_latency_us": 5.0, "megatron-core.gemm_efficiency_scale": 1.0, "unfused.attention_score_bytes": 24.46,
          "legacy.layer_overhead_s": 7.87e-4, "megatron-deepspeed.gemm_efficiency_scale": 1.0,
          "megatron-core.elementwise_bytes": 4.0,
          "deepspeed-0.19.zero3_overlap_fraction": 0.9,  # megatron-core's stated ZeRO-3 overlap
          "deepspeed-0.19.gemm_efficiency_scale": 1.0,
          "hopper.fp8_gemm_fraction": 0.9}  # DeepGEMM's 1,350 of 1,979 FP8 TFLOP/s against bf16's ~75% (gpu.py)
ENGINE_SCALES = ("megatron-deepspeed.gemm_efficiency_scale", "megatron-core.gemm_efficiency_scale",
                 "deepspeed-0.19.gemm_efficiency_scale")
# which runs inform which value (a value no training run informs keeps its prior)
INFORMED_BY = {
    "a100.max_fraction": lambda r: r.cluster.startswith("dgx-a100"),
    "megatron-core.gemm_efficiency_scale": lambda r: r.engine == "megatron-core",
    "a100.nvlink_latency_us": lambda r: r.cluster.startswith("dgx-a100") and r.knobs["tp"] > 1,
    "unfused.attention_score_bytes": lambda r: r.engine in LEGACY,
    "legacy.layer_overhead_s": lambda r: r.engine in LEGACY,
    "megatron-deepspeed.gemm_efficiency_scale": lambda r: r.engine == "megatron-deepspeed",
    "megatron-core.elementwise_bytes": lambda r: r.engine == "megatron-core",
    "deepspeed-0.19.zero3_overlap_fraction": lambda r: r.engine == "deepspeed-0.19" and r.knobs.get("zero") == 3,
    "deepspeed-0.19.gemm_efficiency_scale": lambda r: r.engine == "deepspeed-0.19",
    "hopper.fp8_gemm_fraction": lambda r: False,  # no calibration run is fp8: fitted on the pairs (fp8_fraction_fit)
}
ORDER_GAP = 0.10
A100_MAMF = load_cluster("dgx-a100-80g").gpu.compute_efficiency.mamf_fraction


# ---- prediction --------------------------------------------------------------------------------
def bundled_params() -> dict[str, float]:
    out = {}
    for key, (kind, names, field) in FIT_KEYS.items():
        if kind == "gpu":
            out[key] = getattr(load_cluster(_cluster_with_gpu(names[0])).gpu.compute_efficiency, field)
        elif kind == "tier":
            out[key] = getattr(load_cluster(names[0]).network[0], field)
        else:
            eng = load_engine(names[0])
            out[key] = getattr(eng.efficiency if kind == "engine" else eng.runs_as, field)
    return out


def _cluster_with_gpu(gpu: str) -> str:
    return {"a100-80gb": "dgx-a100-80g", "a100-40gb": "dgx-a100-40g", "h100-sxm": "dgx-h100"}[gpu]


def mamf_tied_ceiling(gpu, theta: dict) -> dict:
    """A GPU generation no calibration run measures, with a measured MAMF share (gpu.py
    ComputeEfficiency.mamf_fraction), gets the A100's fitted ceiling times its MAMF share over
    the A100's: {"max_fraction": value}, or {} for an A100 or a GPU without one."""
    mine, a100 = gpu.compute_efficiency.mamf_fraction, A100_MAMF
    if mine is None or gpu.name in FIT_KEYS["a100.max_fraction"][1]:
        return {}
    return {"max_fraction": theta["a100.max_fraction"] * mine / a100}


@lru_cache(maxsize=512)
def _cluster(name: str, gpus: int, params: tuple):
    base = load_cluster(name)
    nodes = -(-gpus // base.gpus_per_node)
    theta = dict(params)
    updates = {field: theta[key] for key, (kind, names, field) in FIT_KEYS.items()
               if kind == "gpu" and base.gpu.name in names} | mamf_tied_ceiling(base.gpu, theta)
    gpu = base.gpu.model_copy(update={"compute_efficiency": base.gpu.compute_efficiency.model_copy(update=updates)})
    inner = {field: theta[key] for key, (kind, names, field) in FIT_KEYS.items() if kind == "tier" and name in names}
    network = [base.network[0].model_copy(update=inner)] + list(base.network[1:])
    return base.model_copy(update={"nodes": nodes, "gpu": gpu, "network": network})


def run_engine(run: Run, params: tuple):
    """The engine profile a run is predicted with: its own, with `params`, its framework's changes
    and the token dispatcher and all-to-all overlap it ran."""
    return _engine(run.engine, params, run.framework_key, run.dispatcher, run.ep_overlap, run.act_offload)


@lru_cache(maxsize=64)
def _engine(name: str, params: tuple, framework: str = "", dispatcher: str = "alltoall", ep_overlap: str = "none",
            act_offload: str = "none"):
    """The engine profile `name` with the fitted `params`, what `framework` (a
    FRAMEWORK_CHANGES key) runs on top of it, and the MoE `dispatcher`, `ep_overlap` and
    `act_offload` it ran."""
    base = load_engine(name)
    changes = FRAMEWORK_CHANGES.get(framework, {})
    if changes:
        base = base.model_copy(update={"can_run": base.can_run.model_copy(update=changes.get("can_run", {})),
                                       "runs_as": base.runs_as.model_copy(update=changes.get("runs_as", {}))})
    theta = dict(params)
    def updates(section: str) -> dict:
        return {field: theta[key] for key, (kind, names, field) in FIT_KEYS.items() if kind == section and name in names}

    tuned = base.model_copy(update={"efficiency": base.efficiency.model_copy(update=updates("engine")),
                                    "runs_as": base.runs_as.model_copy(update=updates("runs_as"))})
    tuned = tuned if dispatcher == "alltoall" else tuned.with_ep_dispatcher(dispatcher)
    tuned = tuned if ep_overlap == "none" else tuned.with_ep_overlap(ep_overlap)
    return tuned if act_offload == "none" else tuned.with_act_offload(act_offload)


def candidates(run: Run, engine) -> list[Layout]:
    """The layouts the run may have used: its stated knobs, and every value of the unstated
    ones that the engine can run."""
    per_replica = run.training.global_batch // run.knobs["dp"]
    choices = {
        "micro_batch": [b for b in (1, 2, 4, 8, 16) if per_replica % b == 0],
        "vpp": [v for v in run.vpp_choices or (1, 2, 3, 4, 6, 8) if v == 1 or engine.can_run.max_chunks != 1],
        "recompute": list(engine.can_run.recompute),
        "sequence_parallel": [False, True] if engine.can_run.sequence_parallel else [False],
        "zero": list(engine.can_run.zero_with_pp if run.knobs["pp"] > 1 else engine.can_run.zero),
    }
    unknown = [k for k in run.unknown]
    out = []
    for values in product(*(choices[k] for k in unknown)):
        fields = dict(run.knobs, **dict(zip(unknown, values)))
        try:
            out.append(Layout(**fields))
        except ValueError:
            continue
    return out


def predict_run(run: Run, params: tuple) -> tuple[float, Layout | None]:
    """Predicted step time (s) and the layout it was predicted for (fastest that fits among the
    candidates; the fastest of all if none fits)."""
    cluster, engine = _cluster(run.cluster, run.gpus, params), run_engine(run, params)
    best_fit, best_any = (np.inf, None), (np.inf, None)
    for layout in candidates(run, engine):
        try:
            est = estimate(cluster, run.model, run.training, layout, engine)
        except LayoutError:
            continue
        if est.step_time_s < best_any[0]:
            best_any = (est.step_time_s, layout)
        if est.fits and est.step_time_s < best_fit[0]:
            best_fit = (est.step_time_s, layout)
    return best_fit if best_fit[1] is not None else best_any


def predict(runs: list[Run], params: dict) -> np.ndarray:
    key = tuple(sorted(params.items()))
    return np.array([predict_run(r, key)[0] for r in runs])


def resolve(runs: list[Run], params: dict) -> list[Layout | None]:
    """The layout each run is predicted for under `params` (its unstated knobs resolved)."""
    key = tuple(sorted(params.items()))
    return [predict_run(r, key)[1] for r in runs]


def predict_fixed(runs: list[Run], layouts: list[Layout | None], params: dict) -> np.ndarray:
    """Step times of runs whose layouts are already resolved (fits keep them fixed: fast)."""
    key = tuple(sorted(params.items()))
    out = []
    for run, layout in zip(runs, layouts):
        if layout is None:
            out.append(np.nan)
            continue
        est = estimate(_cluster(run.cluster, run.gpus, key), run.model, run.training, layout, run_engine(run, key))
        out.append(est.step_time_s)
    return np.array(out)


# ---- metrics -----------------------------------------------------------------------------------
def errors_pct(runs: list[Run], predicted: np.ndarray) -> np.ndarray:
    measured = np.array([r.measured_s for r in runs])
    return (predicted - measured) / measured * 100


def by_source(runs: list[Run]) -> dict[str, list[int]]:
    groups = defaultdict(list)
    for i, r in enumerate(runs):
        groups[r.source].append(i)
    return dict(groups)


def summary(err: np.ndarray) -> dict:
    finite = err[np.isfinite(err)]
    return {"runs": int(len(err)), "mape_pct": float(np.mean(np.abs(finite))) if len(finite) else float("nan"),
            "bias_pct": float(np.mean(finite)) if len(finite) else float("nan"),
            "max_abs_pct": float(np.max(np.abs(finite))) if len(finite) else float("nan"),
            "unpredicted": int(len(err) - len(finite))}


def source_mape_mean(runs: list[Run], predicted: np.ndarray) -> float:
    err = np.abs(errors_pct(runs, predicted))
    err = np.where(np.isfinite(err), err, 100.0)
    return float(np.mean([err[idx].mean() for idx in by_source(runs).values()]))


def ordering_pairs(runs: list[Run], predicted: np.ndarray) -> list[dict]:
    """Pairs a source compares directly, whose measured times differ by more than ORDER_GAP."""
    groups = defaultdict(list)
    for i, r in enumerate(runs):
        m = r.model
        groups[(r.source, m.layers, m.hidden, m.heads, r.gpus, r.training.global_batch)].append(i)
    pairs = []
    for idx in groups.values():
        for i, j in combinations(idx, 2):
            a, b = runs[i].measured_s, runs[j].measured_s
            if abs(a - b) / min(a, b) <= ORDER_GAP:
                continue
            right = bool((predicted[i] - predicted[j]) * (a - b) > 0)
            pairs.append({"faster": runs[i].id if a < b else runs[j].id, "slower": runs[j].id if a < b else runs[i].id,
                          "measured_ratio": max(a, b) / min(a, b), "right": right})
    return pairs


# ---- fitting -----------------------------------------------------------------------------------
def fit(runs: list[Run], start: dict) -> dict:
    """The FIT_KEYS values (those the runs inform) minimising the mean per-source MAPE."""
    keys = [k for k in FIT_KEYS if any(INFORMED_BY[k](r) for r in runs)]

    def decode(x):
        theta = dict(start)
        for k, v in zip(keys, x):
            lo, hi = BOUNDS[k]
            theta[k] = float(np.clip(v * SCALE[k], lo, hi))
        return theta

    layouts = resolve(runs, start)
    x = nelder_mead(lambda x: source_mape_mean(runs, predict_fixed(runs, layouts, decode(x))),
                    np.array([start[k] / SCALE[k] for k in keys]), step=0.15, iters=120, tol=1e-3, relative=True)
    return pool_engine_scales(decode(x), keys)


def fit_only(runs: list[Run], start: dict, keys: list[str]) -> dict:
    """`keys` fitted on `runs` with every other value held at `start` (a value a new source
    informs, fitted without moving the values the other sources set)."""
    unknown = [k for k in keys if k not in FIT_KEYS]
    if unknown:
        raise SystemExit(f"published.py: --fit-only {', '.join(unknown)}: fit keys are {', '.join(FIT_KEYS)}")

    def decode(x):
        return dict(start) | {k: float(np.clip(v * SCALE[k], *BOUNDS[k])) for k, v in zip(keys, x)}

    layouts = resolve(runs, start)
    x = nelder_mead(lambda x: source_mape_mean(runs, predict_fixed(runs, layouts, decode(x))),
                    np.array([start[k] / SCALE[k] for k in keys]), step=0.15, iters=120, tol=1e-4, relative=True)
    return decode(x)


def pool_engine_scales(theta: dict, informed: list[str]) -> dict:
    """An engine whose runs were not in the fit is assumed to reach the mean GEMM efficiency of
    the engines that were (Megatron-LM 2020-2022, the reference, counting as 1.0): partial
    pooling rather than the optimistic 1.0. The same rule sets the bundled value of engines with
    no published runs (torchtitan)."""
    scales = [1.0] + [theta[k] for k in ENGINE_SCALES if k in informed]
    return theta | {k: float(np.mean(scales)) for k in ENGINE_SCALES if k not in informed}


def leave_one_source_out(runs: list[Run], start: dict) -> tuple[np.ndarray, dict]:
    """Predicted step time of every run by a fit that never saw its source, and those fits."""
    predicted, fits = np.full(len(runs), np.nan), {}
    for source, idx in by_source(runs).items():
        train = [r for i, r in enumerate(runs) if i not in set(idx)]
        fits[source] = fit(train, start)
        predicted[idx] = predict([runs[i] for i in idx], fits[source])
    return predicted, fits


def vtrain_with_engine(params: dict) -> dict:
    """The vTrain rows (Megatron-DeepSpeed 2023, A100) predicted with the megatron-deepspeed profile
    fitted here, on vTrain's network with the catalog A100 instead of vtrain-a100's own GPU values."""
    import accuracy
    key = tuple(sorted(params.items()))
    base = load_cluster("vtrain-a100")
    gpu = _cluster("dgx-a100-80g", 8, key).gpu
    cluster = base.model_copy(update={"gpu": gpu})
    out = {}
    for name, file in accuracy.SETS.items():
        rows = accuracy.read_rows(accuracy.DATA / file)
        predicted = accuracy.predict(cluster, rows, _engine("megatron-deepspeed", key))
        measured = np.array([r["measured_s"] for r in rows])
        out[name] = summary((predicted - measured) / measured * 100)
    return out


# ---- held-out validation -----------------------------------------------------------------------
NOT_YET = ("modelled as dense",)  # estimate() warnings that mean the run's feature is not modelled yet


def held_out(params: dict, path: Path = EXTRA) -> dict:
    """Predictions of the held-out rows under `params` (their times never fitted; the FP8/BF16
    pairs' speed-ups fit hopper.fp8_gemm_fraction, `fp8_fraction_fit`): per row, per source,
    overall, the FP8/BF16 pairs, and every row left out with its reason."""
    runs, excluded, sources = load_extra(path)
    key = tuple(sorted(params.items()))
    rows, layouts = [], {}
    for run in runs:
        predicted, layout = predict_run(run, key)
        why = _not_predicted(run, layout, key)
        if why:
            excluded.append((run.id, why))
            continue
        layouts[run.id] = layout
        rows.append({"id": run.id, "source": run.source, "precision": run.training.precision,
                     "measured_s": run.measured_s, "predicted_s": float(predicted),
                     "error_pct": (predicted - run.measured_s) / run.measured_s * 100, "layout": layout.short(),
                     "resolved": list(run.unknown), "how_measured": run.how_measured, "pair_of": run.pair_of,
                     "moe": run.model.moe is not None,
                     "error_other_count_pct": ((predicted - run.measured_alt_s) / run.measured_alt_s * 100
                                             if run.measured_alt_s else None)})
    groups, other = defaultdict(list), defaultdict(list)
    for row in rows:
        groups[row["source"]].append(row["error_pct"])
        if row["error_other_count_pct"] is not None:
            other[row["source"]].append(row["error_other_count_pct"])
    return {"rows": rows, "sources": {s: summary(np.array(e)) for s, e in groups.items()},
            "sources_other_count": {s: summary(np.array(e)) for s, e in other.items()},
            "all": summary(np.array([r["error_pct"] for r in rows])),
            "moe": summary(np.array([r["error_pct"] for r in rows if r["moe"]])),
            "pairs": fp8_pairs(rows, {r.id: r for r in runs}, layouts, key),
            "fp8_fit": fp8_fraction_fit(rows, {r.id: r for r in runs}, layouts, params),
            "balance": balance_pairs([r for r in runs if r.id in layouts], layouts, key),
            "excluded": excluded, "titles": {k: v.get("title", k) for k, v in sources.items()}}


def _not_predicted(run: Run, layout: Layout | None, key: tuple) -> str | None:
    """Why a held-out run gets no prediction: no candidate layout estimates, or estimate() says a
    feature of the run is not modelled yet."""
    cluster, engine = _cluster(run.cluster, run.gpus, key), run_engine(run, key)
    if layout is None:
        try:
            estimate(cluster, run.model, run.training, Layout(**run.knobs), engine)
        except (LayoutError, ValueError, TypeError) as err:
            return f"no layout plan3d can estimate: {str(err).splitlines()[0]}"
        return "no layout plan3d can estimate"
    warnings = estimate(cluster, run.model, run.training, layout, engine).warnings
    missing = [w for w in warnings if any(s in w for s in NOT_YET)]
    return f"not modelled yet: {missing[0]} (estimate() warning)" if missing else None


def fp8_pairs(rows: list[dict], runs: dict[str, Run], layouts: dict[str, Layout], key: tuple) -> list[dict]:
    """FP8 rows next to the BF16 run they name in `pair_of`: measured and predicted speedups, the
    FP8 run predicted on the layout resolved for its BF16 twin (the source ran both on one layout)."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for r in rows:
        base = by_id.get(r["pair_of"]) if r["pair_of"] else None
        if base:
            run = runs[r["id"]]
            est = estimate(_cluster(run.cluster, run.gpus, key), run.model, run.training, layouts[base["id"]],
                           _engine(run.engine, key, run.framework_key))
            out.append({"fp8": r["id"], "bf16": base["id"], "layout": layouts[base["id"]].short(),
                        "measured_speedup": base["measured_s"] / r["measured_s"],
                        "predicted_speedup": base["predicted_s"] / est.step_time_s})
    return out


FP8_KEY = "hopper.fp8_gemm_fraction"
HOPPER_CLUSTERS = ("dgx-h100", "h800")
FP8_GRID = np.round(np.arange(0.50, 1.0001, 0.01), 2)


def fp8_speedup_errors(rows, runs, layouts, params: dict, fraction: float) -> list[tuple[str, float]]:
    """(source, speed-up error %) of every Hopper FP8/BF16 pair with the fp8 GEMM fraction at `fraction`."""
    key = tuple(sorted((params | {FP8_KEY: float(fraction)}).items()))
    return [(runs[p["fp8"]].source, (p["predicted_speedup"] / p["measured_speedup"] - 1) * 100)
            for p in fp8_pairs(rows, runs, layouts, key) if runs[p["fp8"]].cluster in HOPPER_CLUSTERS]


def fp8_fraction_fit(rows, runs, layouts, params: dict) -> dict:
    """`hopper.fp8_gemm_fraction` fitted on the FP8/BF16 pairs' speed-ups (the only value fitted on
    held-out rows, and on ratios only: each pair is one source running one layout both ways), on a
    grid, minimising the mean over sources of each source's mean |speed-up error|; and left one
    source out: each source's pairs at the value fitted on the others, against the prior."""
    table = {f: fp8_speedup_errors(rows, runs, layouts, params, f) for f in FP8_GRID}
    sources = sorted({s for s, _ in table[FP8_GRID[0]]})

    def score(f, keep):
        per = [np.mean([abs(e) for s, e in table[f] if s == src]) for src in keep]
        return float(np.mean(per)) if per else np.inf

    def best(keep):
        return float(min(FP8_GRID, key=lambda f: (score(f, keep), abs(f - PRIORS[FP8_KEY]))))

    prior = float(min(FP8_GRID, key=lambda f: abs(f - PRIORS[FP8_KEY])))
    loso = {}
    for src in sources:
        others = [s for s in sources if s != src]
        f = best(others) if others else prior
        loso[src] = {"fitted_on_others": f, "error_pct": score(f, [src]), "error_at_prior_pct": score(prior, [src])}
    return {"fitted": best(sources) if sources else prior, "bundled": params[FP8_KEY], "prior": PRIORS[FP8_KEY],
            "error_at_bundled_pct": score(float(min(FP8_GRID, key=lambda f: abs(f - params[FP8_KEY]))), sources),
            "leave_one_source_out": loso}


def balance_pairs(runs: list[Run], layouts: dict[str, Layout], key: tuple) -> list[dict]:
    """Forced-balance rows that also measured dropless routing: the measured slow-down of dropless
    against the one predicted with plan3d's dropless imbalance prior (MOE_IMBALANCE), the layout
    and everything else the same -- a check of that stated prior, not a fit."""
    out = []
    for run in runs:
        if run.measured_dropless_s is None:
            continue
        cluster, engine = _cluster(run.cluster, run.gpus, key), run_engine(run, key)
        dropless = run.model.model_copy(update={"moe": run.model.moe.model_copy(update={"load_factor": None})})
        forced = estimate(cluster, run.model, run.training, layouts[run.id], engine).step_time_s
        prior = estimate(cluster, dropless, run.training, layouts[run.id], engine).step_time_s
        out.append({"id": run.id, "measured_ratio": run.measured_dropless_s / run.measured_s,
                    "predicted_ratio": prior / forced})
    return out


def print_held_out(rep: dict, title: str) -> None:
    print(f"\n## held-out validation ({title}; times never fitted, the fp8 pairs' speed-ups fit the Hopper "
          "fp8 GEMM fraction): published MoE, FP8 and long-context runs, "
          "benchmarks/data/extra_runs.yaml")
    print("(other: the error under the other reading of a FLOP count the source does not state: non-causal for MoE "
          "Parallel Folding, see benchmarks/data/README.md)")
    for source, s in rep["sources"].items():
        print(f"\n### {source}: {rep['titles'].get(source, source)}")
        print(f"{'run':44s} {'prec':5s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'other':>7s}  "
              "layout (resolved knobs)")
        for row in (r for r in rep["rows"] if r["source"] == source):
            resolved = f" ({', '.join(row['resolved'])})" if row["resolved"] else ""
            alt = f"{row['error_other_count_pct']:+6.1f}%" if row["error_other_count_pct"] is not None else f"{'-':>7s}"
            print(f"{row['id']:44s} {row['precision']:5s} {row['measured_s']:9.3f} {row['predicted_s']:9.3f} "
                  f"{row['error_pct']:+6.1f}% {alt}  {row['layout']}{resolved}")
        c = rep["sources_other_count"].get(source)
        alt = f" (other reading: MAPE {c['mape_pct']:.1f}%, bias {c['bias_pct']:+.1f}%)" if c else ""
        print(f"{source}: {s['runs']} runs, MAPE {s['mape_pct']:.1f}%, bias {s['bias_pct']:+.1f}%, "
              f"max {s['max_abs_pct']:.1f}%{alt}")
    a = rep["all"]
    if a["runs"]:
        print(f"\nall held-out runs: {a['runs']} predicted, MAPE {a['mape_pct']:.1f}%, bias {a['bias_pct']:+.1f}%, "
              f"max {a['max_abs_pct']:.1f}%; {len(rep['excluded'])} excluded")
        print_moe_target(rep)
    else:
        print(f"\nall held-out runs: none predicted; {len(rep['excluded'])} excluded")
    for p in rep["pairs"]:
        print(f"fp8/bf16 speedup, {p['fp8']} vs {p['bf16']} (both on {p['layout']}): "
              f"measured {p['measured_speedup']:.3f}x, predicted {p['predicted_speedup']:.3f}x")
    fit = rep.get("fp8_fit")
    if fit:
        print(f"fp8 GEMM fraction (hopper; of the bf16 GEMM efficiency, against the fp8 peak), fitted on the "
              f"pairs' speed-ups: {fit['fitted']:.2f} (used here {fit['bundled']:.2f}, prior {fit['prior']:.2f}); "
              f"mean speed-up error at the value used {fit['error_at_bundled_pct']:.1f}%")
        for src, s in fit["leave_one_source_out"].items():
            print(f"  left out {src}: fitted on the others {s['fitted_on_others']:.2f}, its speed-up error "
                  f"{s['error_pct']:.1f}% (at the prior {s['error_at_prior_pct']:.1f}%)")
    for p in rep.get("balance", []):
        print(f"dropless / forced balance, {p['id']}: measured {p['measured_ratio']:.3f}x, predicted "
              f"{p['predicted_ratio']:.3f}x with the dropless imbalance prior {MOE_IMBALANCE}")
    reasons = defaultdict(list)
    for run_id, why in rep["excluded"]:
        reasons[why].append(run_id)
    print("held-out excluded (reason: runs):")
    for why, ids in reasons.items():
        print(f"  {why}: {', '.join(ids)}")


def print_moe_target(rep: dict) -> None:
    """Issue 29's MoE line: the MoE rows' MAPE, the worst source over its MoE rows, the DeepSeek-V3 row."""
    m = rep["moe"]
    if not m["runs"]:
        return
    by_source = defaultdict(list)
    for row in (r for r in rep["rows"] if r["moe"]):
        by_source[row["source"]].append(abs(row["error_pct"]))
    worst = max(by_source, key=lambda s: np.mean(by_source[s]))
    dsv3 = [f"{r['id']} {r['error_pct']:+.1f}%" for r in rep["rows"] if r["source"] == "deepseek_v3"]
    print(f"held-out MoE runs: {m['runs']} predicted, MAPE {m['mape_pct']:.1f}% (target <= 12%), bias "
          f"{m['bias_pct']:+.1f}%; worst source {worst} {np.mean(by_source[worst]):.1f}% (target <= 20%)"
          + (f"; {', '.join(dsv3)} (target within 20%)" if dsv3 else ""))


# ---- error bands (plan3d/cost/bands.py) ---------------------------------------------------------
def measured_run(run: Run, layout: Layout | None, error_pct: float, how: str, params: dict) -> MeasuredRun | None:
    """A run's left-out (or held-out) prediction error with its region; None for a run without a
    prediction, or run by software that has no profile of its own (predicted with another's)."""
    if layout is None or not np.isfinite(error_pct) or not run.ran_on_engine:
        return None
    gpu = _cluster(run.cluster, run.gpus, tuple(sorted(params.items()))).gpu.generation_name
    engine = load_engine(run.engine) if run.engine in bundled_names("engine") else None
    region = Region.of(run.engine, gpu, layout.zero, layout.cp, run.model.moe is not None, run.training.precision,
                       sharded_stages(engine), layout.pipeline_schedule, offload=run.act_offload != "none")
    return MeasuredRun(id=run.id, source=run.source, gpus=run.gpus, error_pct=float(error_pct), how=how,
                       **{k: getattr(region, k) for k in REGION_FIELDS})


def band_data(runs: list[Run], loso_pred: np.ndarray, params: dict, held: dict | None) -> BandData:
    """Every run's error under values that never saw its source: leave-one-source-out for the
    calibration set, the bundled values for the held-out rows (never fitted on)."""
    layouts = resolve(runs, params)
    out = [measured_run(r, lay, e, "left-out", params)
           for r, lay, e in zip(runs, layouts, errors_pct(runs, loso_pred))]
    if held:
        extra = {r.id: r for r in load_extra()[0]}
        for row in held["rows"]:
            run = extra[row["id"]]
            out.append(measured_run(run, predict_run(run, tuple(sorted(params.items())))[1], row["error_pct"],
                                    "held-out", params))
    return BandData(generated_by="benchmarks/published.py --loso --write-bands", commit=git_commit(),
                    runs=tuple(r for r in out if r is not None))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def write_bands(data: BandData, path: Path = BAND_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# Written by benchmarks/published.py --loso --write-bands: every published run's prediction error\n"
              "# (predicted / measured - 1, per cent) under values that never saw its source, with its region.\n"
              "# plan3d/cost/bands.py turns them into error bands. Do not edit by hand.\n")
    path.write_text(header + yaml.safe_dump(data.model_dump(mode="json"), sort_keys=False, width=120))


def band_report(data: BandData) -> dict:
    """Each region's band and, for every source, how many of its runs fall inside the band made
    without it (what a user of a new source would have been told)."""
    regions = defaultdict(list)
    for run in data.runs:
        regions[Region(**{k: getattr(run, k) for k in REGION_FIELDS})].append(run)
    rows = []
    for region, members in sorted(regions.items(), key=lambda kv: -len(kv[1])):
        band = band_of(region, max(r.gpus for r in members), data)
        inside = [_inside(r, band_of(region, r.gpus, without_source(data, r.source))) for r in members]
        rows.append({"region": region.name, "runs": len(members), "sources": sorted({r.source for r in members}),
                     "band_error_pct": [100 * band.low, 100 * band.high], "step_band_pct": list(band.band_pct()),
                     "validated": band.validated, "left_out_inside": int(sum(inside))})
    total = sum(r["runs"] for r in rows)
    inside = sum(r["left_out_inside"] for r in rows)
    return {"regions": rows, "runs": total, "inside": inside, "coverage": inside / total if total else float("nan")}


def _inside(run: MeasuredRun, band) -> bool:
    return band.low - 1e-12 <= run.error_pct / 100 <= band.high + 1e-12


def print_bands(rep: dict) -> None:
    print("\n## error bands (plan3d/cost/bands.py): central 80% of left-out errors by region; coverage: each "
          "source's runs against the band made without that source")
    print(f"{'region':58s} {'runs':>4s} {'error band':>16s} {'step band':>16s} {'validated':>9s} {'inside':>7s}  sources")
    for r in rep["regions"]:
        lo, hi = r["band_error_pct"]
        slo, shi = r["step_band_pct"]
        print(f"{r['region']:58s} {r['runs']:4d} {lo:+7.1f}/{hi:+6.1f}% {slo:+7.1f}/{shi:+6.1f}% "
              f"{'yes' if r['validated'] else 'no':>9s} {r['left_out_inside']:3d}/{r['runs']:<3d}  {', '.join(r['sources'])}")
    print(f"left-out runs inside the band made without their source: {rep['inside']} of {rep['runs']} "
          f"({rep['coverage']:.0%}; target >= 80%)")


# ---- output ------------------------------------------------------------------------------------
def report(runs: list[Run], predicted: np.ndarray, params: dict) -> dict:
    err = errors_pct(runs, predicted)
    key = tuple(sorted(params.items()))
    rows = []
    for r, p, e in zip(runs, predicted, err):
        layout = predict_run(r, key)[1]
        rows.append({"id": r.id, "source": r.source, "engine": r.engine, "measured_s": r.measured_s,
                     "predicted_s": float(p), "error_pct": float(e),
                     "layout": layout.short() if layout else None, "resolved": list(r.unknown)})
    pairs = ordering_pairs(runs, predicted)
    return {"rows": rows, "sources": {s: summary(err[idx]) for s, idx in by_source(runs).items()},
            "all": summary(err), "source_mape_mean_pct": source_mape_mean(runs, predicted),
            "orderings": {"pairs": len(pairs), "right": sum(p["right"] for p in pairs), "list": pairs},
            "params": params}


def print_report(title: str, rep: dict, per_run: bool = True) -> None:
    print(f"\n## {title}")
    if per_run:
        print(f"{'run':42s} {'engine':18s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  layout (resolved knobs)")
        for row in rep["rows"]:
            resolved = f" ({', '.join(row['resolved'])})" if row["resolved"] else ""
            print(f"{row['id']:42s} {row['engine']:18s} {row['measured_s']:9.3f} {row['predicted_s']:9.3f} "
                  f"{row['error_pct']:+6.1f}%  {row['layout']}{resolved}")
    print(f"\n{'source':22s} {'runs':>4s} {'MAPE':>7s} {'bias':>7s} {'max':>7s}")
    for source, s in rep["sources"].items():
        print(f"{source:22s} {s['runs']:4d} {s['mape_pct']:6.1f}% {s['bias_pct']:+6.1f}% {s['max_abs_pct']:6.1f}%")
    a = rep["all"]
    print(f"{'all runs':22s} {a['runs']:4d} {a['mape_pct']:6.1f}% {a['bias_pct']:+6.1f}% {a['max_abs_pct']:6.1f}%")
    print(f"mean of the per-source MAPEs: {rep['source_mape_mean_pct']:.1f}%")
    o = rep["orderings"]
    print(f"orderings (pairs differing by > {ORDER_GAP:.0%}): {o['right']} of {o['pairs']} right")
    for p in o["list"]:
        if not p["right"]:
            print(f"  wrong: {p['faster']} measured {p['measured_ratio']:.2f}x faster than {p['slower']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="runs.yaml (default: ../shared/data/published)")
    parser.add_argument("--fit", action="store_true", help="fit the global values on every source and print them")
    parser.add_argument("--fit-only", nargs="+", metavar="KEY", help="fit only these values on every source, the "
                        "others at their bundled values (how a new source's values were fitted)")
    parser.add_argument("--loso", action="store_true", help="also the leave-one-source-out table (refits, minutes)")
    parser.add_argument("--vtrain", action="store_true", help="also the vTrain rows with the megatron-deepspeed "
                        "profile on the catalog A100 (an out-of-fit check of the engine profile)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--extra", type=Path, default=EXTRA, help="held-out runs (default: data/extra_runs.yaml)")
    parser.add_argument("--no-held-out", action="store_true", help="leave out the held-out validation section")
    parser.add_argument("--write-bands", action="store_true", help="with --loso: write every run's left-out error "
                        "to plan3d's bundled error bands (plan3d/bundled/validation/error_bands.yaml)")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"published.py: {args.data} not found; pass --data PATH/runs.yaml", file=sys.stderr)
        return 2
    runs, excluded = load(args.data)
    if args.extra.is_file():  # the extra sources fitted on like the calibration set (their `role`)
        more, more_excluded, _ = load_extra(args.extra, role="calibration")
        runs, excluded = runs + more, excluded + more_excluded
    params = bundled_params()
    if args.fit:  # no calibration run informs the Hopper fp8 fraction: it keeps its pair-fitted value
        params = fit(runs, PRIORS | {FP8_KEY: params[FP8_KEY]})
    elif args.fit_only:
        params = fit_only(runs, params, args.fit_only)
    out = {"fitted" if args.fit or args.fit_only else "bundled": report(runs, predict(runs, params), params),
           "excluded": excluded}
    if args.loso:
        predicted, fits = leave_one_source_out(runs, PRIORS)
        out["leave_one_source_out"] = report(runs, predicted, params) | {"fits": fits}
    if args.vtrain:
        out["vtrain_with_engine"] = vtrain_with_engine(params)
    if not args.no_held_out and args.extra.is_file():
        out["held_out"] = held_out(params, args.extra)
    if args.write_bands and not args.loso:
        print("published.py: --write-bands needs --loso (the bands are made of left-out errors)", file=sys.stderr)
        return 2
    if args.loso:
        data = band_data(runs, predicted, params, out.get("held_out"))
        if args.write_bands:
            write_bands(data)
        out["bands"] = band_report(data)
    else:
        out["bands"] = band_report(load_band_data())  # the bundled bands
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    title = "fitted on every source" if args.fit else "fitted: " + ", ".join(args.fit_only) if args.fit_only else "bundled values"
    print_report(f"{title}: {', '.join(f'{k}={v:.4g}' for k, v in params.items())}", out.get("bundled") or out["fitted"])
    print("\nexcluded:", "; ".join(f"{i} ({why})" for i, why in excluded))
    if args.vtrain:
        print("\n## vTrain rows, megatron-deepspeed profile on the catalog A100 (not in the fit)")
        for name, s in out["vtrain_with_engine"].items():
            print(f"{name:12s} {s['runs']:5d} rows  MAPE {s['mape_pct']:5.1f}%  bias {s['bias_pct']:+5.1f}%")
    if args.loso:
        print_report("leave-one-source-out (each source predicted by a fit that never saw it)",
                     out["leave_one_source_out"], per_run=False)
    if "held_out" in out:
        print_held_out(out["held_out"], "fitted values" if args.fit or args.fit_only else "bundled values")
    print_bands(out["bands"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
