"""Does calibration make the cost model predict this machine? Calibrate, launch, compare.

    .venv/bin/python benchmarks/calibration_check.py [--nproc 4|8] [--model bench-gpt|tiny-gpt]
        [--steps 6] [--out runs/calibration-check] [--spec SPEC.yaml (skip the micro-benchmarks)]

1. `plan3d calibrate` on --nproc local ranks (gloo): GEMM, memory-bound and collective sweeps -> spec.
2. For each layout: a plan under that spec (fp32, as the CPU runtime trains), `launch` it for
   --steps steps, read the measured mean step time (first step excluded) from summary.json.
3. Table A: predicted (micro-benchmark calibration only) vs measured.
4. Table B: `calibrate --from-run` refit (the achieved-FLOP/s multiplier) on the first REFERENCE
   layouts only, then predicted vs measured on the others (held out).
5. Table C: leave-one-out; each layout predicted by a refit on all the others (same session, so
   the same background load on a shared machine).
Writes OUT/results.json. Timing is the point here, so run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plan3d.calibrate import refit_from_runs
from plan3d.cost.estimate import estimate
from plan3d.run.launch import launch
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

BENCH_GPT = ModelSpec(name="bench-gpt", layers=8, hidden=256, heads=8, vocab=2048, seq_len=128,
                      default_global_batch=16, source="benchmarks/calibration_check.py")
# Layouts per world size. The first REFERENCE of each list are the ones the refit of table B
# sees; the rest are held out. (The runtime reduces gradients in one flat bucket per group since
# this session; before, ZeRO-0 all-reduced every parameter tensor apart.)
LAYOUTS = {
    2: {  # one rank per core on this 2-core machine: no oversubscription
        "dp2-z1": Layout(dp=2, micro_batch=2, zero=1),
        "tp2-sp": Layout(tp=2, micro_batch=2, sequence_parallel=True),
        "pp2-mb2": Layout(pp=2, micro_batch=2),
        "tp2-mb4": Layout(tp=2, micro_batch=4),
        "pp2-mb1": Layout(pp=2, micro_batch=1),
        "pp2-vpp2": Layout(pp=2, vpp=2, micro_batch=2),
        "dp2-z3-mb4": Layout(dp=2, micro_batch=4, zero=3),
        "tp2-full": Layout(tp=2, micro_batch=2, recompute="full"),
        "dp2-zero0": Layout(dp=2, micro_batch=2),
    },
    4: {
        "tp2-dp2-z1": Layout(tp=2, dp=2, micro_batch=2, zero=1),
        "pp2-dp2-z1": Layout(pp=2, dp=2, micro_batch=2, zero=1),
        "dp4-z1": Layout(dp=4, micro_batch=2, zero=1),
        "tp2-pp2": Layout(tp=2, pp=2, micro_batch=2),
        "tp4-sp": Layout(tp=4, micro_batch=4, sequence_parallel=True),
        "pp4-mb1": Layout(pp=4, micro_batch=1),
        "tp2-pp2-full": Layout(tp=2, pp=2, micro_batch=2, recompute="full"),
        "pp2-dp2-zero0": Layout(pp=2, dp=2, micro_batch=2),
    },
    8: {  # four ranks per core: oversubscribed, as `make demo` runs
        "dp8-z1": Layout(dp=8, micro_batch=2, zero=1),
        "demo": Layout(tp=2, pp=2, dp=2, micro_batch=4),  # what `make demo` now picks
        "tp2-pp2-dp2-vpp2": Layout(tp=2, pp=2, dp=2, micro_batch=4, vpp=2),
        "tp2-pp2-dp2-sp-z2": Layout(tp=2, pp=2, dp=2, micro_batch=4, vpp=4, zero=2, sequence_parallel=True),
        "tp2-pp2-dp2-z1": Layout(tp=2, pp=2, dp=2, micro_batch=2, zero=1),
        "pp4-dp2-z1": Layout(pp=4, dp=2, micro_batch=1, zero=1),
        "pp2-dp4": Layout(pp=2, dp=4, micro_batch=2),
        "tp2-dp4-z1": Layout(tp=2, dp=4, micro_batch=2, zero=1),
        "tp4-pp2-sp": Layout(tp=4, pp=2, micro_batch=2, sequence_parallel=True),
        "dp8-zero0": Layout(dp=8, micro_batch=2),
    },
}
REFERENCE = 1


def calibrate(out: Path, model_name: str, nproc: int, statistic: str) -> Path:
    spec = out / "cpu-calibrated.yaml"
    cmd = [str(Path(sys.executable).parent / "plan3d"), "calibrate", "--nproc", str(nproc), "--model", model_name,
           "--tp", "1,2,4", "--micro-batch", "1,2,4", "--max-bytes", str(1 << 22),
           "--run-dir", str(out / "calibrate"), "--out", str(spec),
           "--statistic", statistic, "--repeats", "5" if statistic == "min" else "3"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return spec


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> None:
    """On a shared machine: wait (up to max_wait_s) until the 1-minute load average drops below max_load."""
    deadline = time.monotonic() + max_wait_s
    while max_load is not None and os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5)


def run_layout(cluster, model, training, name: str, layout: Layout, out: Path, steps: int, statistic: str) -> dict:
    est = estimate(cluster, model, training, layout)
    plan = build_plan(cluster, model, training, layout, est.to_dict())
    start = time.monotonic()
    result = launch(plan, None, out / name, steps=steps, backend="gloo", worker_args=["--no-save"])
    if not result.ok:
        raise SystemExit(f"{name}: launch failed (rank {result.failed_rank}): {result.error}")
    summary = json.loads((out / name / "summary.json").read_text())
    steps_s = [json.loads(line)["step_time_s"] for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"layout": name, "short": layout.short(), "predicted_s": est.step_time_s,
            # the first step pays start-up; min (best step) or median of the others: both are robust
            # to other processes on a shared machine, min the more so when interference comes and goes
            "measured_s": (min if statistic == "min" else statistics.median)(steps_s[1:]),
            "median_s": statistics.median(steps_s[1:]), "mean_s": summary["step_time_s"],
            "min_s": min(steps_s[1:]), "load_avg_1min": os.getloadavg()[0], "wall_s": time.monotonic() - start}


def table(title: str, rows: list[dict], key: str = "predicted_s") -> None:
    print(f"\n{title}")
    print("| layout | predicted ms | measured ms | error | median ms | min ms | load avg |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        error = r[key] / r["measured_s"] - 1
        print(f"| {r['layout']} | {r[key] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {error:+.1%} | "
              f"{r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | {r['load_avg_1min']:.1f} |")
    worst = max(abs(r[key] / r["measured_s"] - 1) for r in rows)
    print(f"worst |error|: {worst:.1%} over {len(rows)} layouts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-gpt", help="bench-gpt (built in) or a model spec name/path")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/calibration-check"))
    parser.add_argument("--spec", type=Path, default=None, help="use this calibrated spec (skip step 1)")
    parser.add_argument("--only", default=None, help="comma list of layout names")
    parser.add_argument("--from-results", type=Path, default=None,
                        help="recompute the tables from a results.json (no launches)")
    parser.add_argument("--wait-load", type=float, default=None,
                        help="before each launch and the calibration, wait for the 1-min load average below this")
    parser.add_argument("--wait-max-s", type=float, default=180.0)
    parser.add_argument("--statistic", default="median", choices=["median", "min"],
                        help="of the timings, in the calibration and of the steps")
    parser.add_argument("--nproc", type=int, default=2, choices=sorted(LAYOUTS),
                        help="ranks per launch (and for the calibration): 2, 4 or 8 on this 2-core machine")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = BENCH_GPT if args.model == "bench-gpt" else load_model(args.model)
    if args.from_results:
        return tables_from_results(args, model)
    if args.model == "bench-gpt":
        (args.out / "bench-gpt.yaml").write_text(json.dumps(model.model_dump(exclude_none=True)))
        model_ref = str(args.out / "bench-gpt.yaml")
    else:
        model_ref = args.model
    wait_for_quiet(args.wait_load, args.wait_max_s)
    spec = args.spec or calibrate(args.out, model_ref, args.nproc, args.statistic)
    layouts = LAYOUTS[args.nproc]
    cluster = load_cluster(str(spec))
    training = TrainingSpec(global_batch=model.default_global_batch or 16, precision="fp32")
    names = args.only.split(",") if args.only else list(layouts)
    rows = []
    for name in names:
        wait_for_quiet(args.wait_load, args.wait_max_s)
        rows.append(run_layout(cluster, model, training, name, layouts[name], args.out, args.steps, args.statistic))
        print(f"{name}: predicted {rows[-1]['predicted_s'] * 1e3:.1f} ms, measured {rows[-1]['measured_s'] * 1e3:.1f} ms",
              flush=True)
    table(f"A. micro-benchmark calibration only ({spec})", rows)
    refit_rows(cluster, model, training, rows, layouts)
    print(f"\nmeasured = {args.statistic} of steps 2..{args.steps}; command: {' '.join(sys.argv)}")
    (args.out / "results.json").write_text(json.dumps({"spec": str(spec), "model": model.name, "nproc": args.nproc, "statistic": args.statistic,
                                                       "rows": rows}, indent=1))


def tables_from_results(args, model) -> None:
    saved = json.loads(args.from_results.read_text())
    cluster = load_cluster(saved["spec"])
    training = TrainingSpec(global_batch=model.default_global_batch or 16, precision="fp32")
    rows, layouts = saved["rows"], LAYOUTS[saved["nproc"]]
    table(f"A. micro-benchmark calibration only ({saved['spec']})", rows)
    refit_rows(cluster, model, training, rows, layouts)


def refit_rows(cluster, model, training, rows: list[dict], layouts: dict) -> None:
    """Table B: refit on the REFERENCE layouts, predict the held-out ones."""
    reference, held_out = rows[:REFERENCE], rows[REFERENCE:]

    def predict(layout_rows):
        return lambda c: [estimate(c, model, training, layouts[r["layout"]]).step_time_s for r in layout_rows]

    refit, fitted = refit_from_runs(cluster, predict(reference), [r["measured_s"] for r in reference])
    for r, p in zip(rows, predict(rows)(refit)):
        r["refit_s"] = p
    knobs = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in fitted.items() if k.endswith("overhead_s"))
    print(f"\nrefit on {', '.join(r['layout'] for r in reference)}: throughput x{fitted['throughput_scale']:.3f}"
          + (f", {knobs}" if knobs else ""))
    if held_out:
        table("B. after --from-run refit, held-out layouts only", held_out, key="refit_s")
    if len(rows) >= 3:
        for i, r in enumerate(rows):  # C: leave one out, the refit sees every other run of this session
            others = rows[:i] + rows[i + 1:]
            refit, _ = refit_from_runs(cluster, predict(others), [o["measured_s"] for o in others])
            r["loo_s"] = predict([r])(refit)[0]
        table("C. leave-one-out: refit on all other layouts of this session, predict the one left out", rows,
              key="loo_s")


if __name__ == "__main__":
    main()
