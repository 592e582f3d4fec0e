"""How well plan3d predicts per-GPU memory, and whether it lets every published layout run.

    .venv/bin/python benchmarks/memory.py           # tables
    .venv/bin/python benchmarks/memory.py --json    # the same figures for machines
    .venv/bin/python benchmarks/memory.py --fit     # + the reserve and allocator overhead fitted per engine

(a) Measured peaks. Every published per-GPU memory figure in the data, estimated with the engine
profile of the software that ran it on the bundled cluster of its GPU, with the layout as
published: ../shared/data/published/runs.yaml (`measured.max_gpu_memory_gb` of its runs and its
`memory_measurements` tables) and data/memory_runs.yaml (further public measurements, each with
its source). The figure compared is the maximum over the ranks the source measured (BLOOM: the
nodes holding the word embedding, pipeline stages 0 and p-1).

What a figure is matters. nvidia-smi (every BLOOM figure) shows the process's whole footprint:
the CUDA context (1,573 MiB on an A100 by the BLOOM authors' own measurement), NCCL's buffers,
and everything PyTorch's caching allocator holds, including blocks it freed and kept cached.
`torch.cuda.max_memory_allocated` shows only the live tensors at the peak. plan3d's total is
the allocator's peak plus the engine's reserve (context, NCCL, fragmentation), i.e. it is meant
to stay at or above nvidia-smi at the peak: the memory a run needs to not fail. An allocator-peak
figure would be compared against the total without the reserve row.

(b) Published layouts as published. Every run of runs.yaml and data/extra_runs.yaml, its stated
knobs fixed and every value of the unstated ones the engine can run (`published.candidates`):
- refused by a rule: no candidate the engine and plan3d's layout rules accept (the sentence is
  printed);
- false refusal: estimable, but no candidate fits (target 0), printed with the memory terms of
  the smallest candidate;
- forced full recompute: the recompute is not stated and only full recompute fits; flagged as
  ruled out where the measured step time is more than 10% faster than predicted with full
  recompute and a candidate without it predicts the step closer (the source's time says the run
  did not recompute everything);
- out of memory called fitting: rows the source records as OOM that plan3d says fit (target 0).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's plan3d
import published  # noqa: E402
from published_runs import DATA, EXTRA, Excluded, Run, extra_to_run, to_run  # noqa: E402

from plan3d.cost.estimate import Estimate, estimate  # noqa: E402
from plan3d.errors import LayoutError  # noqa: E402
from plan3d.layout import Layout  # noqa: E402
from plan3d.specs.catalog import load_cluster, load_engine  # noqa: E402
from plan3d.specs.model import ModelSpec  # noqa: E402
from plan3d.specs.training import TrainingSpec  # noqa: E402
from plan3d.vocab import MEMORY_TERMS  # noqa: E402

GIB = 2**30
MEMORY_RUNS = Path(__file__).resolve().parent / "data" / "memory_runs.yaml"
A100_CLUSTERS = {"A100-SXM4-80GB": "dgx-a100-80g", "A100-SXM4-40GB": "dgx-a100-40g"}
RULED_OUT_PCT = 10.0  # full recompute predicted this much slower than measured, and a lighter choice closer


@dataclass
class Case:
    """One published memory outcome: a number (`peak`), or only whether the run ran (`fits`) or
    ran out of memory (`oom`)."""

    id: str
    source: str
    location: str
    engine: str
    cluster: str
    gpus: int
    model: ModelSpec
    training: TrainingSpec
    layout: Layout
    outcome: str  # peak | fits | oom
    measured_gib: float | None = None
    reading: str = "nvidia-smi"
    ranks: str = "embedding"  # embedding: pipeline stages 0 and p-1; all: the most loaded rank
    contradicted_by: str = ""  # the row of the same table whose reading this one contradicts, and how


# ---- reading the data ---------------------------------------------------------------------------
def bloom_model(name: str, layers: int, hidden: int, heads: int, vocab: int = 250680, seq: int = 2048) -> ModelSpec:
    """A BLOOM-shaped model (BigScience tr11): GELU MLP of 4h, LayerNorm, biases, ALiBi, tied
    embeddings, dropout 0.1 (tr11 README: "The default Megatron-LM dropout settings are inherited")."""
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq,
                     position="alibi", tied_embeddings=True, dropout=0.1)


GRADS = {"16-bit": False, "fp32": True, None: None}


def bloom_training(gbs: int, precision: str, grads: str | None) -> TrainingSpec:
    return TrainingSpec(global_batch=gbs, precision=precision, fp32_grad_accum=GRADS[grads])


def bloom_layout(row: dict, recompute: str = "full") -> Layout:
    zero = int(row.get("zero", row.get("zero_stage", 1)))
    fields = dict(tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]), micro_batch=int(row["mbs"]),
                  zero=zero, recompute=recompute)  # as configured: ZeRO-1 over one rank is not ZeRO-0 to DeepSpeed (GradientBuffer.unsharded_step_cast_bytes)
    if row.get("pp_layers"):
        fields["pp_layers"] = tuple(row["pp_layers"])
    return Layout(**fields)


def outcome_of(value) -> tuple[str, float | None]:
    if isinstance(value, str) and value.strip().upper() == "OOM":
        return "oom", None
    return "peak", float(value)


def runs_yaml_cases(path: Path = DATA) -> list[Case]:
    """The memory figures of runs.yaml: its runs' `measured.max_gpu_memory_gb` and its
    `memory_measurements` tables (read with the shapes their `location` names)."""
    data = yaml.safe_load(path.read_text())
    out = []
    for row in data["runs"]:
        mem = (row.get("measured") or {}).get("max_gpu_memory_gb")
        if mem is None:
            continue
        run = to_run(row, require_time=False)
        out.append(Case(id=run.id, source=run.source, location=row["source"]["location"], engine=run.engine,
                        cluster=run.cluster, gpus=run.gpus, model=run.model, training=run.training,
                        layout=Layout(**run.knobs), outcome="peak", measured_gib=float(mem)))
    by_id = {row["id"]: row for row in data["runs"]}
    for table in data.get("memory_measurements", []):
        out += _measurement_table(table, by_id)
    return out


def _measurement_table(table: dict, runs: dict) -> list[Case]:
    tid = table.get("id")
    if tid in ("bloom-prequel-181b-mbs-sweep", "bloom-prequel-181b-zero-stage", "bloom-prequel-181b-low-tp-oom"):
        # 'NHIDDEN=14336 NLAYERS=72 NHEADS=64, 384 A100-80GB, GBS 2048 (2016 where dp does not divide 2048),
        # ZeRO-1, fp16' (the table's location); fp16 gradients until the BF16_Optimizer of 02-28
        model = bloom_model("bloom-181b", 72, 14336, 64)
        cases = []
        for i, row in enumerate(table["rows"]):
            outcome, value = outcome_of(row["mem_gb"])
            gbs = 2048 if 2048 % (int(row["dp"]) * int(row["mbs"])) == 0 else 2016
            layout = bloom_layout(row)
            cases.append(Case(id=f"{tid}/{layout.short()}", source="bloom_tr11", location=table["location"],
                              engine="megatron-deepspeed", cluster="dgx-a100-80g", gpus=layout.world_size,
                              model=model, training=bloom_training(gbs, "fp16", "16-bit"), layout=layout,
                              outcome=outcome, measured_gib=value))
        return cases
    if tid == "gptneox-20b-40gb-fit":
        run = to_run(runs["gptneox-20b-production-96gpu"], require_time=False)
        row = table["rows"][0]
        layout = Layout(tp=row["tp"], pp=row["pp"], dp=row["gpus"] // (row["tp"] * row["pp"]), zero=row["zero"],
                        micro_batch=row["mbs"], recompute="full" if row["activation_checkpointing"] else "none")
        return [Case(id=tid, source="gptneox", location=table["location"], engine=run.engine, cluster="dgx-a100-40g",
                     gpus=row["gpus"], model=run.model, training=run.training, layout=layout,
                     outcome="fits" if row["fits"] else "oom", reading="fits", ranks="all")]
    return []  # formula statements, checkpoint sizes: no per-GPU memory of a layout


def memory_runs_cases(path: Path = MEMORY_RUNS) -> list[Case]:
    """data/memory_runs.yaml: one case per table row, the table's defaults under the row's fields."""
    data = yaml.safe_load(path.read_text())
    out = []
    for table in data["tables"]:
        for row in table["rows"]:
            r = {**table["defaults"], **row}
            model = bloom_model(f"{table['id']}/{row['id']}", r["layers"], r["hidden"], r["heads"], r["vocab"],
                                r["seq_len"])
            layout = bloom_layout(r, r["recompute"])
            outcome, value = outcome_of(r["mem_gb"])
            out.append(Case(id=f"{table['id']}/{row['id']}", source=table["source"]["ref"],
                            location=table["source"]["location"], engine=table["engine"],
                            cluster=A100_CLUSTERS[table["gpu"]], gpus=layout.world_size, model=model,
                            training=bloom_training(int(r["gbs"]), r["precision"], r["grads"]), layout=layout,
                            outcome=outcome, measured_gib=value, contradicted_by=row.get("contradicted_by", "")))
    return out


# ---- estimating --------------------------------------------------------------------------------
def sized_cluster(name: str, gpus: int):
    base = load_cluster(name)
    return base.model_copy(update={"nodes": max(1, math.ceil(gpus / base.gpus_per_node))})


def estimate_case(case: Case) -> Estimate:
    return estimate(sized_cluster(case.cluster, case.gpus), case.model, case.training, case.layout,
                    load_engine(case.engine))


def measured_ranks_gib(case: Case, est: Estimate) -> float:
    """The predicted figure for the ranks the source measured."""
    stages = est.stage_memory_bytes
    if case.ranks == "embedding":
        return max(stages[0], stages[-1]) / GIB
    return est.peak_memory_bytes / GIB


def terms_gib(est: Estimate) -> dict:
    return {k: est.memory_bytes[k] / GIB for k in MEMORY_TERMS}


def peaks_report(cases: list[Case]) -> dict:
    rows = []
    for case in cases:
        try:
            est = estimate_case(case)
        except (LayoutError, ValueError) as err:
            rows.append({"id": case.id, "outcome": case.outcome, "error": str(err).splitlines()[0]})
            continue
        predicted = measured_ranks_gib(case, est)
        row = {"id": case.id, "source": case.source, "engine": case.engine, "outcome": case.outcome,
               "reading": case.reading, "layout": case.layout.short(), "precision": case.training.precision,
               "measured_gib": case.measured_gib, "predicted_gib": predicted, "fits": est.fits,
               "capacity_gib": est.capacity_bytes / GIB, "worst_pp_rank": est.worst_pp_rank, "terms_gib": terms_gib(est),
               "contradicted_by": case.contradicted_by}
        if case.measured_gib is not None:
            row["error_pct"] = (predicted - case.measured_gib) / case.measured_gib * 100
        rows.append(row)
    return {"rows": rows, "summary": peaks_summary(rows)}


def peaks_summary(rows: list[dict]) -> dict:
    err = np.array([r["error_pct"] for r in rows if "error_pct" in r])
    return {"peaks": int(len(err)),
            "mean_abs_error_pct": float(np.mean(np.abs(err))) if len(err) else float("nan"),
            "bias_pct": float(np.mean(err)) if len(err) else float("nan"),
            "worst_under_pct": float(np.min(err)) if len(err) else float("nan"),
            "worst_over_pct": float(np.max(err)) if len(err) else float("nan"),
            "under_by_more_than_10pct": int(np.sum(err < -10)),
            "under_by_more_than_10pct_contradicted": sum(1 for r in rows if r.get("error_pct", 0) < -10 and r["contradicted_by"]),
            "measured_running_called_not_fitting": sum(1 for r in rows if r.get("outcome") in ("peak", "fits")
                                                       and r.get("fits") is False),
            "oom_rows": sum(1 for r in rows if r.get("outcome") == "oom"),
            "oom_called_fitting": sum(1 for r in rows if r.get("outcome") == "oom" and r.get("fits")),
            "not_estimated": sum(1 for r in rows if "error" in r)}


# ---- published layouts as published ------------------------------------------------------------
def published_runs() -> tuple[list[Run], list[tuple[str, str]]]:
    """Every run of runs.yaml and extra_runs.yaml with its layout, step time or not; and the rows
    whose layout plan3d cannot express (with the reason)."""
    runs, skipped = [], []
    for path, read in ((DATA, to_run), (EXTRA, extra_to_run)):
        for row in yaml.safe_load(path.read_text())["runs"]:
            try:
                runs.append(read(row, require_time=False))
            except Excluded as why:
                skipped.append((row["id"], str(why)))
    return runs, skipped


def layouts_report(runs: list[Run]) -> dict:
    key = tuple(sorted(published.bundled_params().items()))
    rows = [layout_row(run, key) for run in runs]
    kinds = ("fits", "refused_by_rule", "false_refusal", "forced_full", "forced_full_ruled_out")
    return {"rows": rows, "counts": {k: sum(1 for r in rows if r["verdict"] == k or (k == "forced_full" and r["verdict"]
                                                                                   == "forced_full_ruled_out"))
                                     for k in kinds}, "runs": len(rows)}


def layout_row(run: Run, key: tuple) -> dict:
    cluster, engine = published._cluster(run.cluster, run.gpus, key), published.run_engine(run, key)
    estimated, refusal = [], None
    for layout in published.candidates(run, engine):
        try:
            estimated.append((layout, estimate(cluster, run.model, run.training, layout, engine)))
        except LayoutError as err:
            refusal = refusal or str(err).splitlines()[0]
    row = {"id": run.id, "source": run.source, "engine": run.engine, "stated": _stated(run), "resolved": list(run.unknown)}
    if not estimated:
        if refusal is None:
            try:
                estimate(cluster, run.model, run.training, Layout(**run.knobs), engine)
            except (LayoutError, ValueError) as err:
                refusal = str(err).splitlines()[0]
        return row | {"verdict": "refused_by_rule", "why": refusal or "no candidate layout"}
    fitting = [(lay, est) for lay, est in estimated if est.fits]
    if not fitting:
        lay, est = min(estimated, key=lambda pair: pair[1].peak_memory_bytes)
        return row | {"verdict": "false_refusal", "layout": lay.short(), "peak_gib": est.peak_memory_bytes / GIB,
                      "capacity_gib": est.capacity_bytes / GIB, "terms_gib": terms_gib(est),
                      "device_gib": cluster.gpu.memory_gib}
    best_lay, best = min(fitting, key=lambda pair: pair[1].step_time_s)
    row |= {"layout": best_lay.short(), "peak_gib": best.peak_memory_bytes / GIB}
    if "recompute" in run.unknown and all(lay.recompute == "full" for lay, _ in fitting):
        lighter = [(lay, est) for lay, est in estimated if lay.recompute != "full"]
        lay, est = min(lighter, key=lambda pair: est_gap(pair[1]))
        row |= {"lightest_not_full": lay.short(), "lightest_peak_gib": est.peak_memory_bytes / GIB,
                "lightest_capacity_gib": est.capacity_bytes / GIB, "lightest_terms_gib": terms_gib(est)}
        verdict = "forced_full"
        if math.isfinite(run.measured_s):
            full_err = (best.step_time_s - run.measured_s) / run.measured_s * 100
            alt = min(lighter, key=lambda pair: abs(pair[1].step_time_s - run.measured_s))[1]
            alt_err = (alt.step_time_s - run.measured_s) / run.measured_s * 100
            row |= {"full_error_pct": full_err, "lighter_error_pct": alt_err}
            if full_err > RULED_OUT_PCT and abs(alt_err) < abs(full_err):
                verdict = "forced_full_ruled_out"
        return row | {"verdict": verdict}
    return row | {"verdict": "fits"}


def est_gap(est: Estimate) -> float:
    return est.peak_memory_bytes - est.capacity_bytes


def _stated(run: Run) -> str:
    return " ".join(f"{k}={v}" for k, v in run.knobs.items())


# ---- fitting the reserve -----------------------------------------------------------------------
FIT_MIN_PEAKS = 10  # an engine needs this many nvidia-smi peaks to have its reserve fitted
RESERVE_GRID = np.arange(0.0, 16.0, 0.1)  # GiB
OVERHEAD_GRID = np.arange(0.0, 0.6, 0.01)


def fit_reserve(rows: list[dict]) -> dict:
    """Per engine with FIT_MIN_PEAKS nvidia-smi peaks: the reserve R (GiB) and allocator overhead
    fraction f minimising the mean |error| of live + R + f * (activations + buffers) against the
    measured figures (live = the prediction without its reserve row), on a grid; and the same
    fit left out table by table (each table of a source predicted by a fit on the others)."""
    out = {}
    for engine in sorted({r["engine"] for r in rows if "error_pct" in r}):
        mine = [r for r in rows if r.get("engine") == engine and "error_pct" in r and r["reading"] == "nvidia-smi"]
        if len(mine) < FIT_MIN_PEAKS:
            continue
        meas = np.array([r["measured_gib"] for r in mine])
        live = np.array([r["predicted_gib"] - r["terms_gib"]["reserve"] for r in mine])
        varying = np.array([r["terms_gib"]["activations"] + r["terms_gib"]["buffers"] for r in mine])
        tables = np.array([r["id"].split("/")[0] for r in mine])

        def best(idx):
            pred = live[idx][None, None] + RESERVE_GRID[:, None, None] + OVERHEAD_GRID[None, :, None] * varying[idx]
            mae = np.mean(np.abs(pred - meas[idx]) / meas[idx], axis=-1)
            i, j = np.unravel_index(np.argmin(mae), mae.shape)
            return float(RESERVE_GRID[i]), float(OVERHEAD_GRID[j])

        reserve, overhead = best(np.ones(len(mine), bool))
        held_out = np.zeros(len(mine))
        for table in set(tables):
            r_t, f_t = best(tables != table)
            test = tables == table
            held_out[test] = (live[test] + r_t + f_t * varying[test] - meas[test]) / meas[test] * 100
        fitted = (live + reserve + overhead * varying - meas) / meas * 100
        out[engine] = {"reserved_memory_gib": reserve, "allocator_overhead_fraction": overhead, "peaks": len(mine),
                       "in_sample": _errors(fitted), "leave_one_table_out": _errors(held_out)}
    return out


def _errors(err: np.ndarray) -> dict:
    return {"mean_abs_error_pct": float(np.mean(np.abs(err))), "bias_pct": float(np.mean(err)),
            "worst_under_pct": float(np.min(err))}


# ---- output -------------------------------------------------------------------------------------
def fmt_terms(terms: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in terms.items())


def print_peaks(rep: dict) -> None:
    print("## (a) measured per-GPU memory vs predicted (GiB; nvidia-smi figures, taken as GiB)")
    print(f"{'case':62s} {'layout':34s} {'prec':4s} {'meas':>5s} {'pred':>6s} {'error':>7s}  terms of the most loaded rank")
    for r in rep["rows"]:
        if "error" in r:
            print(f"{r['id']:62s} not estimated: {r['error']}")
            continue
        meas = f"{r['measured_gib']:5.0f}" if r["measured_gib"] is not None else f"{r['outcome']:>5s}"
        err = f"{r['error_pct']:+6.1f}%" if "error_pct" in r else ("  fits " if r["fits"] else "  refuse")
        print(f"{r['id'][:62]:62s} {r['layout'][:34]:34s} {r['precision']:4s} {meas} {r['predicted_gib']:6.1f} "
              f"{err}  {fmt_terms(r['terms_gib'])}")
    s = rep["summary"]
    print(f"\n{s['peaks']} measured peaks: mean |error| {s['mean_abs_error_pct']:.1f}%, bias {s['bias_pct']:+.1f}%, "
          f"worst under-prediction {s['worst_under_pct']:+.1f}%, worst over-prediction {s['worst_over_pct']:+.1f}%, "
          f"{s['under_by_more_than_10pct']} under-predicted by more than 10% "
          f"(of them {s['under_by_more_than_10pct_contradicted']} contradicted by another reading of the same source)")
    for r in rep["rows"]:
        if r.get("error_pct", 0) < -10 and r.get("contradicted_by"):
            print(f"  contradicted: {r['id']}: {r['contradicted_by']}")
    print(f"runs that ran but are called not fitting: {s['measured_running_called_not_fitting']}; "
          f"out-of-memory rows called fitting: {s['oom_called_fitting']} of {s['oom_rows']}; "
          f"not estimated: {s['not_estimated']}")


def print_layouts(rep: dict, skipped: list) -> None:
    c = rep["counts"]
    print(f"\n## (b) published layouts as published ({rep['runs']} runs of runs.yaml and extra_runs.yaml)")
    print(f"fit with some unstated-knob choice: {c['fits'] + c['forced_full']}; refused by a rule: {c['refused_by_rule']}; "
          f"false refusals (no choice fits): {c['false_refusal']}; accepted only with full recompute: {c['forced_full']} "
          f"(of which ruled out by the measured time: {c['forced_full_ruled_out']})")
    for r in rep["rows"]:
        v = r["verdict"]
        if v == "refused_by_rule":
            print(f"  refused  {r['id']}: {r['why']}")
        elif v == "false_refusal":
            within = (f" (within the {r['device_gib']:g} GiB device: refused by the planning headroom only)"
                      if r["peak_gib"] <= r["device_gib"] else "")
            print(f"  FALSE REFUSAL {r['id']} ({r['engine']}): smallest {r['layout']} needs {r['peak_gib']:.1f} of "
                  f"{r['capacity_gib']:.1f} GiB{within}: {fmt_terms(r['terms_gib'])}")
        elif v.startswith("forced_full"):
            times = (f"; full recompute {r['full_error_pct']:+.0f}% vs measured, without it {r['lighter_error_pct']:+.0f}%"
                     if "full_error_pct" in r else "")
            flag = "RULED OUT" if v == "forced_full_ruled_out" else "full only"
            print(f"  {flag:9s} {r['id']} ({r['engine']}): {r['layout']}; without full recompute "
                  f"{r['lightest_not_full']} needs {r['lightest_peak_gib']:.1f} of {r['lightest_capacity_gib']:.1f} GiB "
                  f"({fmt_terms(r['lightest_terms_gib'])}){times}")
    if skipped:
        print(f"not expressible as a plan3d layout ({len(skipped)}): " + "; ".join(f"{i} ({w})" for i, w in skipped))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fit", action="store_true", help="fit each engine's reserve and allocator overhead on its "
                        "nvidia-smi peaks (and print them left out table by table)")
    args = parser.parse_args(argv)
    cases = runs_yaml_cases() + memory_runs_cases()
    peaks = peaks_report(cases)
    if args.fit:
        peaks["fit"] = fit_reserve(peaks["rows"])
    runs, skipped = published_runs()
    layouts = layouts_report(runs)
    if args.json:
        print(json.dumps({"schema_version": 1, "peaks": peaks, "layouts": layouts, "not_expressible": skipped}, indent=1))
        return 0
    print_peaks(peaks)
    for engine, f in peaks.get("fit", {}).items():
        print(f"\nfit for {engine} ({f['peaks']} nvidia-smi peaks): reserved_memory_gib {f['reserved_memory_gib']:.1f}, "
              f"allocator_overhead_fraction {f['allocator_overhead_fraction']:.2f}; in sample: mean |error| "
              f"{f['in_sample']['mean_abs_error_pct']:.1f}%, bias {f['in_sample']['bias_pct']:+.1f}%; each table left "
              f"out: {f['leave_one_table_out']['mean_abs_error_pct']:.1f}%, bias "
              f"{f['leave_one_table_out']['bias_pct']:+.1f}%, worst under {f['leave_one_table_out']['worst_under_pct']:+.1f}%")
    print_layouts(layouts, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
