"""Accuracy of the performance model against measured Megatron-DeepSpeed runs (vTrain data).

    .venv/bin/python benchmarks/accuracy.py            # table with the bundled vtrain-a100 spec
    .venv/bin/python benchmarks/accuracy.py --json     # the same figures for machines
    .venv/bin/python benchmarks/accuracy.py --fit      # refit the efficiency values on half the rows
    .venv/bin/python benchmarks/accuracy.py --cross-validate  # refit without each multi-node model in turn
    .venv/bin/python benchmarks/accuracy.py --ceilings  # how far a per-group correction could go

Every row of ../shared/data/vtrain/*.csv (relative to the repository root; --data DIR to change)
is predicted with `estimate_batch` on the bundled `vtrain-a100` cluster: GPT blocks (FFN 4h,
GELU, vocabulary 50257, tied embeddings), fp16 with 16-bit gradients, Adam, full recompute, 1F1B,
no ZeRO. --fit fits the global efficiency values (GEMM curve, elementwise bytes, attention-score
bytes, link efficiencies) on the even-numbered rows of each file with a Nelder-Mead search
(numpy only) and reports the error on the odd-numbered rows, which the fit did not see.
--cross-validate is the harder test of "fit physics, not rows": each multi-node model (sweep) in
turn is left out of the fit entirely (the fit sees the other three and the even single-node rows)
and then predicted. --ceilings asks what the targets demand: it scales the predictions of each
group of rows (same model and tp, say) by that group's own geometric-mean error, measured on
those very rows, and reports what even that in-sample oracle reaches.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from fitting import nelder_mead
from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.layout import DEFAULT_ORDER
from plan3d.specs.catalog import load_cluster
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "vtrain"
SETS = {"multi_node": "ground_truth_multi.csv", "single_node": "ground_truth_single.csv"}
VOCAB = 50257
FP32_GRADS = False  # Megatron-LM fp16 default: 16-bit gradients, all-reduced in fp16
EFF_KEYS = ("max_fraction", "half_work_flops", "elementwise_bytes", "attention_score_bytes", "layer_overhead_s",
            "micro_batch_overhead_s")
FIT_KEYS = EFF_KEYS + ("nvlink_efficiency", "ib_efficiency", "nvlink_latency_us")


# ---- data ------------------------------------------------------------------------------------
def read_rows(path: Path) -> list[dict]:
    """Rows as dicts of ints (and the measured time in seconds)."""
    names = {"# GPUs": "gpus", "global batch": "global_batch", "micro batch": "mb", "hidden size": "hidden",
             "attention heads": "heads", "# layers": "layers", "sequence length": "seq",
             "tensor parallelism": "tp", "data parallelism": "dp", "pipeline parallelism": "pp"}
    rows = []
    with path.open() as f:
        for index, raw in enumerate(csv.DictReader(f)):
            row = {names[k]: int(v) for k, v in raw.items() if k in names}
            row["measured_s"] = float(raw["iteration time (ms)"]) / 1e3
            row["index"] = index
            rows.append(row)
    return rows


def row_specs(row: dict) -> tuple[ModelSpec, TrainingSpec]:
    model = ModelSpec(name=f"gpt-h{row['hidden']}-l{row['layers']}", layers=row["layers"], hidden=row["hidden"],
                      heads=row["heads"], vocab=VOCAB, seq_len=row["seq"], tied_embeddings=True)
    training = TrainingSpec(global_batch=row["global_batch"], precision="fp16", fp32_grad_accum=FP32_GRADS)
    return model, training


# ---- prediction ------------------------------------------------------------------------------
def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups = defaultdict(list)
    for row in rows:
        groups[(row["hidden"], row["heads"], row["layers"], row["seq"], row["global_batch"], row["gpus"])].append(row)
    return groups


def predict(cluster: ClusterSpec, rows: list[dict], engine=None) -> np.ndarray:
    """Predicted step time (s) of every row, one estimate_batch per model and GPU count (with
    `engine`'s values; none: the cluster's own, as fitted on this data)."""
    out = np.empty(len(rows))
    position = {id(r): i for i, r in enumerate(rows)}
    for group in group_rows(rows).values():
        model, training = row_specs(group[0])
        nodes = -(-group[0]["gpus"] // cluster.gpus_per_node)
        sized = cluster if nodes == cluster.nodes else cluster.model_copy(update={"nodes": nodes})
        col = lambda k: np.array([r[k] for r in group])  # noqa: E731
        n = len(group)
        cands = Candidates(col("tp"), col("pp"), col("dp"), col("mb"), np.ones(n), np.zeros(n),
                           np.full(n, RECOMPUTE_CODES["full"]), np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64))
        times = estimate_batch(sized, model, training, cands, (DEFAULT_ORDER,), engine)["step_time_s"]
        for row, t in zip(group, times):
            out[position[id(row)]] = t
    return out


# ---- metrics ---------------------------------------------------------------------------------
def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman)."""
    order = np.argsort(values, kind="mergesort")
    r = np.empty(len(values))
    r[order] = np.arange(len(values))
    for v in np.unique(values):
        same = values == v
        r[same] = r[same].mean()
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def indices_by(rows: list[dict], key: tuple[str, ...]) -> dict[tuple, list[int]]:
    """Row indices grouped by the values of the columns in `key`."""
    groups = defaultdict(list)
    for i, row in enumerate(rows):
        groups[tuple(row[k] for k in key)].append(i)
    return dict(groups)


def sweep_rows(rows: list[dict]) -> dict[tuple, list[int]]:
    """Row indices of each sweep: same model (hidden, heads, layers, sequence) and GPU count."""
    sweeps = indices_by(rows, ("hidden", "heads", "layers", "seq", "gpus"))
    return {k: v for k, v in sweeps.items() if len(v) >= 3}


def metrics(rows: list[dict], predicted: np.ndarray) -> dict:
    measured = np.array([r["measured_s"] for r in rows])
    err = np.abs(predicted - measured) / measured * 100
    rhos = [spearman(predicted[idx], measured[idx]) for idx in sweep_rows(rows).values()]
    rhos = [x for x in rhos if x == x]
    return {"mape_pct": float(err.mean()), "median_abs_pct": float(np.median(err)),
            "max_abs_pct": float(err.max()), "spearman_min": float(min(rhos)) if rhos else float("nan"),
            "spearman_mean": float(np.mean(rhos)) if rhos else float("nan"), "rows": len(rows),
            "sweeps": len(rhos)}


# ---- fitting ---------------------------------------------------------------------------------
def with_params(cluster: ClusterSpec, theta: dict) -> ClusterSpec:
    data = cluster.model_dump()
    eff = data["gpu"]["compute_efficiency"]
    for key in EFF_KEYS:
        eff[key] = theta[key]
    data["network"][0]["efficiency"] = theta["nvlink_efficiency"]
    data["network"][1]["efficiency"] = theta["ib_efficiency"]
    data["network"][0]["latency_us"] = theta["nvlink_latency_us"]
    return ClusterSpec.model_validate(data)


def current_params(cluster: ClusterSpec) -> dict:
    eff = cluster.gpu.compute_efficiency
    theta = {k: getattr(eff, k) for k in EFF_KEYS}
    theta["nvlink_efficiency"], theta["ib_efficiency"] = cluster.network[0].efficiency, cluster.network[1].efficiency
    theta["nvlink_latency_us"] = cluster.network[0].latency_us
    return theta


FRACTIONS = {"max_fraction", "nvlink_efficiency", "ib_efficiency"}  # in (0, 1); the rest > 0


def decode(x: np.ndarray) -> dict:
    """Unconstrained vector -> parameters within their physical bounds (logistic or exp)."""
    return {k: float(1 / (1 + np.exp(-v)) if k in FRACTIONS else np.exp(v)) for k, v in zip(FIT_KEYS, x)}


def encode(theta: dict) -> np.ndarray:
    def one(key):
        v = theta[key]
        return np.log(min(v, 0.999) / (1 - min(v, 0.999))) if key in FRACTIONS else np.log(max(v, 1e-12))
    return np.array([one(k) for k in FIT_KEYS])


def fit(cluster: ClusterSpec, train: dict[str, list[dict]], restarts: int = 1) -> dict:
    """Parameters minimising the mean of the per-set MAPEs on the training rows."""
    def loss(x):
        c = with_params(cluster, decode(x))
        return float(np.mean([metrics(rows, predict(c, rows))["mape_pct"] for rows in train.values()]))
    x = encode(current_params(cluster))
    for _ in range(restarts):  # a fresh simplex around the best point escapes early collapse
        x = nelder_mead(loss, x)
    return decode(x)


# ---- what the data allow -------------------------------------------------------------------
CEILING_KEYS = {  # the multi-node models differ in hidden size, so "hidden" names the model there
    "multi_node": {"model, tp": ("hidden", "tp"), "model, tp, pp": ("hidden", "tp", "pp")},
    "single_node": {"hidden, tp, micro-batch": ("hidden", "tp", "mb")},
}


def group_corrected(rows: list[dict], predicted: np.ndarray, key: tuple[str, ...]) -> np.ndarray:
    """Predictions scaled, group by group (rows equal in `key`), by the geometric mean of
    measured / predicted over that group's own rows: the best a model could do that is right up
    to one factor per group. An in-sample oracle, not a model: it bounds what any smooth term in
    the grouped quantities could gain."""
    measured = np.array([r["measured_s"] for r in rows])
    out = predicted.copy()
    for idx in indices_by(rows, key).values():
        out[idx] *= np.exp(np.mean(np.log(measured[idx] / predicted[idx])))
    return out


def ceilings(data: dict[str, list[dict]], cluster: ClusterSpec) -> dict[str, dict]:
    """Metrics of the model and of each per-group oracle, per set."""
    out = {}
    for name, rows in data.items():
        predicted = predict(cluster, rows)
        out[f"{name}: model"] = metrics(rows, predicted)
        for label, key in CEILING_KEYS[name].items():
            out[f"{name}: per {label}"] = metrics(rows, group_corrected(rows, predicted, key))
    return out


def cross_validate(cluster: ClusterSpec, data: dict[str, list[dict]]) -> dict[str, dict]:
    """Leave one multi-node sweep (model) out: fit on the other sweeps and the even single-node
    rows, then predict the sweep left out (none of its rows seen by the fit); last, all the
    left-out predictions pooled."""
    multi = data["multi_node"]
    single_train = [r for r in data["single_node"] if r["index"] % 2 == 0]
    pooled, out = np.empty(len(multi)), {}
    for idx in sweep_rows(multi).values():
        held, left_out = [multi[i] for i in idx], set(idx)
        train = {"multi_node": [r for i, r in enumerate(multi) if i not in left_out], "single_node": single_train}
        pooled[idx] = predict(with_params(cluster, fit(cluster, train)), held)
        out[f"h={held[0]['hidden']} L={held[0]['layers']} {held[0]['gpus']} GPUs"] = metrics(held, pooled[idx])
    out["all left-out rows"] = metrics(multi, pooled)
    return out


# ---- report ----------------------------------------------------------------------------------
def print_table(title: str, results: dict) -> None:
    print(title)
    width = max(12, *(len(name) for name in results))
    print(f"{'set':<{width}} {'rows':>5} {'MAPE %':>7} {'median %':>9} {'max %':>7} {'rho min':>8} "
          f"{'rho mean':>9} {'sweeps':>6}")
    for name, m in results.items():
        print(f"{name:<{width}} {m['rows']:>5} {m['mape_pct']:>7.2f} {m['median_abs_pct']:>9.2f} {m['max_abs_pct']:>7.2f} "
              f"{m['spearman_min']:>8.3f} {m['spearman_mean']:>9.3f} {m['sweeps']:>6}")


def print_sweeps(rows: list[dict], predicted: np.ndarray) -> None:
    print("multi-node sweeps (hidden, layers, GPUs): rows, Spearman, MAPE %")
    measured = np.array([r["measured_s"] for r in rows])
    for (hidden, _, layers, _, gpus), idx in sorted(sweep_rows(rows).items()):
        mape = np.mean(np.abs(predicted[idx] - measured[idx]) / measured[idx]) * 100
        print(f"  h={hidden:<6} L={layers:<4} {gpus:>4} GPUs: {len(idx):>3} rows, "
              f"rho {spearman(predicted[idx], measured[idx]):.3f}, MAPE {mape:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder with the vTrain CSV files")
    parser.add_argument("--cluster", default="vtrain-a100", help="cluster spec (name or file)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fit", action="store_true", help="refit efficiency values on the even rows")
    parser.add_argument("--restarts", type=int, default=1, help="with --fit: Nelder-Mead runs from the best point")
    mode.add_argument("--cross-validate", action="store_true",
                        help="refit with each multi-node model left out, report that model")
    mode.add_argument("--ceilings", action="store_true", help="metrics of per-group in-sample oracles")
    parser.add_argument("--write", type=Path, help="with --fit: write the fitted cluster spec (YAML) here")
    args = parser.parse_args(argv)
    cluster = load_cluster(args.cluster)
    data = {name: read_rows(args.data / file) for name, file in SETS.items()}
    if args.fit:
        train = {k: [r for r in rows if r["index"] % 2 == 0] for k, rows in data.items()}
        test = {k: [r for r in rows if r["index"] % 2 == 1] for k, rows in data.items()}
        theta = fit(cluster, train, args.restarts)
        fitted = with_params(cluster, theta)
        print(json.dumps(theta, indent=1))
        if args.write:
            import yaml

            args.write.write_text(yaml.safe_dump(fitted.model_dump(mode="json"), sort_keys=False))
        print_table("held-out (odd rows, not seen by the fit)",
                    {k: metrics(rows, predict(fitted, rows)) for k, rows in test.items()})
        print_table("training rows", {k: metrics(rows, predict(fitted, rows)) for k, rows in train.items()})
        return 0
    if args.cross_validate or args.ceilings:
        results = cross_validate(cluster, data) if args.cross_validate else ceilings(data, cluster)
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            print_table("left-out model (fit never saw it)" if args.cross_validate
                        else "the model, and oracles exact up to one factor per group", results)
        return 0
    results = {k: metrics(rows, predict(cluster, rows)) for k, rows in data.items()}
    if args.json:
        keys = ("mape_pct", "median_abs_pct", "max_abs_pct", "spearman_min", "spearman_mean", "rows")
        print(json.dumps({k: {key: m[key] for key in keys} for k, m in results.items()}, indent=1))
    else:
        print_table(f"step-time error of {cluster.name} against {args.data}", results)
        print_sweeps(data["multi_node"], predict(cluster, data["multi_node"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
