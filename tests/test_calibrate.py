"""Calibration fits: recover known parameters from synthetic measurements; the worker and CLI on gloo."""
from __future__ import annotations

import json

import pytest

from plan3d.calibrate import (calibrated_cluster, collective_groups, collective_terms, fit_compute_efficiency,
                              fit_measurements, fit_memory_bandwidth, fit_tier, layer_gemms, refit_from_runs,
                              scaled_compute, sweep_config, write_calibrated_spec)
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.gpu import ComputeEfficiency

PEAK = 1e14


def synthetic_gemms(max_fraction: float, half_work: float, noise: float = 0.0) -> list[dict]:
    out = []
    for i, work in enumerate([1e6, 1e7, 1e8, 1e9, 1e10, 1e11]):
        eff = max_fraction * work / (work + half_work)
        out.append({"flops": work, "time_s": work / (PEAK * eff) * (1 + noise * (-1) ** i)})
    return out


@pytest.mark.parametrize("max_fraction,half_work", [(0.7, 2e9), (0.45, 5e7), (0.9, 0.0)])
def test_compute_fit_recovers_the_curve(max_fraction, half_work):
    fit = fit_compute_efficiency(synthetic_gemms(max_fraction, half_work), PEAK)
    assert fit.efficiency.max_fraction == pytest.approx(max_fraction, rel=1e-6)
    assert fit.efficiency.half_work_flops == pytest.approx(half_work, rel=1e-6, abs=1.0)
    assert fit.max_rel_error < 1e-6 and fit.peak_flops == PEAK


def test_compute_fit_tolerates_noise_and_raises_a_low_peak():
    noisy = fit_compute_efficiency(synthetic_gemms(0.6, 1e8, noise=0.05), PEAK)
    assert noisy.efficiency.max_fraction == pytest.approx(0.6, rel=0.1)
    assert 0.03 < noisy.max_rel_error < 0.15
    beaten = fit_compute_efficiency(synthetic_gemms(0.8, 1e8), PEAK / 2)  # catalog peak half the truth
    assert beaten.efficiency.max_fraction == 1.0
    assert beaten.peak_flops * 1.0 == pytest.approx(PEAK * 0.8, rel=1e-6)


def alpha_beta_samples(bw: float, alpha: float) -> list[dict]:
    """Samples timed by the cost model's own collective costs (plan3d.cost.comm), so a fit that
    recovers (bw, alpha) reads the same ring volumes and hops as the model that will use them."""
    from plan3d.cost.comm import COST_OF, p2p_s

    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        for n in (2, 4, 8):
            for size in (4096, 65536, 1 << 20, 1 << 24):
                time_s = p2p_s(size, bw, alpha) if op == "p2p" else COST_OF[op](size, n, bw, alpha)
                out.append({"op": op, "group_size": n, "bytes": size, "time_s": time_s})
    return out


@pytest.mark.parametrize("bw,alpha", [(2.5e10, 5e-6), (1e9, 3e-4), (4.5e11, 0.0)])
def test_tier_fit_recovers_bandwidth_and_latency(bw, alpha):
    fit = fit_tier(alpha_beta_samples(bw, alpha), tier_index=0)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6, abs=1e-12)


def test_p2p_is_fitted_apart_from_the_collectives():
    from plan3d.calibrate import fit_ops

    samples = [s for s in alpha_beta_samples(1e9, 8e-4) if s["op"] != "p2p"]
    samples += [dict(s, time_s=s["bytes"] / 3e9 + 5e-5) for s in alpha_beta_samples(1e9, 0) if s["op"] == "p2p"]
    collective, p2p = fit_tier(samples, 0), fit_ops(samples, 0)["p2p"]
    assert collective.latency_s == pytest.approx(8e-4, rel=1e-6)
    assert p2p.latency_s == pytest.approx(5e-5, rel=1e-6) and p2p.bandwidth_bytes_per_s == pytest.approx(3e9, rel=1e-6)


def test_each_collective_kind_gets_its_own_fit_and_lands_in_the_spec():
    from plan3d.calibrate import fit_ops

    samples = [s for s in alpha_beta_samples(5e8, 1e-3) if s["op"] in ("all_reduce", "all_gather")]
    samples += [s for s in alpha_beta_samples(1e8, 2.5e-3) if s["op"] == "reduce_scatter"]
    fits = fit_ops(samples, 0)
    assert fits["reduce_scatter"].latency_s == pytest.approx(2.5e-3, rel=1e-6)
    assert fits["reduce_scatter"].bandwidth_bytes_per_s == pytest.approx(1e8, rel=1e-6)
    assert fit_tier(samples, 0).latency_s == pytest.approx(1e-3, rel=1e-6)  # the tier's own: all-reduce
    base = load_cluster("local-cpu")  # loopback catalog bandwidth 1 GB/s
    raw = {"device": "cpu", "gemm": synthetic_gemms(0.5, 1e5), "collectives": [dict(s, tier=0) for s in samples]}
    fitted = calibrated_cluster(base, fit_measurements(base, raw, "fp32"), "test")
    tier = fitted.tiers()[0]
    assert tier.cost("reduce_scatter") == pytest.approx((1e8, 2.5e-3), rel=1e-6)
    assert tier.cost("all_gather") == pytest.approx((5e8, 1e-3), rel=1e-6)
    assert tier.cost("all_reduce") == pytest.approx((5e8, 1e-3), rel=1e-6)
    assert fitted.gpu.compute_efficiency.host_overlap is False  # CPU: one core dispatches and computes
    assert fitted.cpu_cores_per_node == base.cpu_cores_per_node  # not recorded: left alone
    with_cores = calibrated_cluster(base, fit_measurements(base, {**raw, "cpu_cores": 6}, "fp32"), "test")
    assert with_cores.cpu_cores_per_node == 6


def test_collective_terms_match_the_ring_formulas():
    assert collective_terms("all_reduce", 4, 1000) == (1500.0, 6)
    assert collective_terms("all_gather", 4, 1000) == (750.0, 3)
    assert collective_terms("reduce_scatter", 4, 1000) == (750.0, 3)
    assert collective_terms("p2p", 2, 1000) == (1000, 1)
    with pytest.raises(ValueError, match="broadcast"):
        collective_terms("broadcast", 4, 1000)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "p2p"])
def test_the_fit_reads_the_volumes_the_cost_model_prices(op):
    """A calibration row (volume, hops) times (1/bw, alpha) is the cost model's time, to the bit."""
    from plan3d.cost.comm import COST_OF, p2p_s

    for n, size, bw, alpha in [(2, 4096, 1e9, 1e-5), (8, 1 << 24, 4.5e11, 3e-6), (72, 123457, 2.5e10, 0.0)]:
        volume, hops = collective_terms(op, n, size)
        model = p2p_s(size, bw, alpha) if op == "p2p" else COST_OF[op](size, n, bw, alpha)
        assert volume / bw + hops * alpha == model


def test_memory_bandwidth_fit():
    samples = [{"bytes": b, "time_s": b / 3e9} for b in (1e4, 1e6, 1e8)]
    bw, worst = fit_memory_bandwidth(samples)
    assert bw == pytest.approx(3e9) and worst < 1e-9


def test_layer_gemms_follow_the_tp_split():
    model = load_model("llama3-8b")
    one, eight = layer_gemms(model, 1024, 1, 2), layer_gemms(model, 1024, 8, 2)
    flops = lambda gs: sum(2 * g["batch"] * g["m"] * g["n"] * g["k"] for g in gs)  # noqa: E731
    assert flops(one) == pytest.approx(8 * flops(eight))
    qkv = one[0]
    assert qkv["n"] == (model.heads + 2 * model.kv_heads_) * model.head_dim_ and qkv["m"] == 2048


def test_collective_groups_inside_and_across_nodes():
    kinds = collective_groups(load_cluster("dgx-h100", nodes=2), 16)
    sizes = [(len(k["members"]), len(k["members"][0]), k["tier"]) for k in kinds]
    assert sizes == [(8, 2, 0), (4, 4, 0), (2, 8, 0), (8, 2, 1)]
    assert kinds[-1]["members"][3] == [3, 11]


def test_calibrated_spec_round_trips_and_estimate_uses_it(tmp_path):
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.specs.training import TrainingSpec

    base = load_cluster("local-cpu")
    raw = {"device": "cpu", "backend": "gloo", "world_size": 8,
           "gemm": synthetic_gemms(0.5, 1e5), "elementwise": [{"bytes": 1e6, "time_s": 1e-4}],
           "collectives": [dict(s, tier=0) for s in alpha_beta_samples(3e8, 1e-4)]}
    fit = fit_measurements(base, raw, "fp32")
    fitted = calibrated_cluster(base, fit, "test")
    assert fitted.gpu.compute_efficiency.dp_overlap_fraction == 0.0  # CPU: reduction shares the cores
    path = tmp_path / "cpu.yaml"
    write_calibrated_spec(fitted, raw, path)
    loaded = load_cluster(str(path))
    assert loaded.tiers()[0].effective_bytes_per_s == pytest.approx(3e8, rel=1e-6)
    assert loaded.gpu.hbm_tbytes_per_s * 1e12 == pytest.approx(1e10)
    assert json.loads((tmp_path / "cpu.yaml.measurements.json").read_text())["world_size"] == 8
    model, training, layout = load_model("tiny-gpt"), TrainingSpec(global_batch=16, precision="fp32"), Layout(dp=8)
    assert estimate(loaded, model, training, layout).step_time_s != estimate(base, model, training, layout).step_time_s


def test_refit_from_runs_recovers_a_throughput_scale():
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.specs.training import TrainingSpec

    base = load_cluster("local-cpu")
    model, training = load_model("tiny-gpt"), TrainingSpec(global_batch=16, precision="fp32")
    layouts = [Layout(dp=8), Layout(tp=2, dp=4), Layout(pp=2, dp=4, micro_batch=1)]

    def predict(cluster):
        return [estimate(cluster, model, training, layout).step_time_s for layout in layouts]

    truth = predict(scaled_compute(base, 0.3))
    refit, fitted = refit_from_runs(base, predict, truth, fit_overhead=False)
    assert fitted["throughput_scale"] == pytest.approx(0.3, rel=1e-3)
    assert predict(refit) == pytest.approx(truth, rel=1e-3)


@pytest.mark.runtime  # measures with the runtime: torch
def test_worker_measures_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("torch", reason="measuring needs the runtime (pip install 'plan3d[runtime]')")
    from plan3d.runtime.calibrate_worker import run_local

    config = sweep_config(load_cluster("local-cpu"), load_model("tiny-gpt"), 32, 2, "cpu", [1], [1], [4096], 1)
    config.update(target_s=0.0005, threads=1, ops=["all_reduce", "p2p"])
    raw = run_local(config, 2, tmp_path)
    assert len(raw["gemm"]) == 6 and all(g["time_s"] > 0 for g in raw["gemm"])
    assert {c["op"] for c in raw["collectives"]} == {"all_reduce", "p2p"}
    assert all(c["time_s"] > 0 and c["group_size"] == 2 for c in raw["collectives"])
    assert all(c["in_step"] for c in raw["collectives"])  # measured between bursts of layer work
    assert raw["cpu_cores"] >= 1
    assert (tmp_path / "progress").read_text().split()[0] == (tmp_path / "progress").read_text().split()[1]


@pytest.mark.runtime  # measures with the runtime: torch
def test_cli_calibrate_writes_a_spec_that_estimate_reads(tmp_path, capsys):
    pytest.importorskip("torch", reason="measuring needs the runtime (pip install 'plan3d[runtime]')")
    from plan3d.cli import main

    out = tmp_path / "not-yet" / "cpu.yaml"  # --out into a folder that does not exist yet
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--nproc", "2", "--tp", "1", "--micro-batch", "1,2", "--max-bytes", "16384",
              "--repeats", "1", "--run-dir", str(tmp_path / "run"), "--out", str(out), "--json"])
    assert info.value.code in (0, None)
    result = json.loads(capsys.readouterr().out)
    assert {r["quantity"] for r in result["rows"]} >= {"max fraction of peak", "latency per hop"}
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--cluster", str(out), "--model", "tiny-gpt", "--dp", "2", "--json"])
    assert info.value.code in (0, None)
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


def test_cli_calibrate_rejects_a_bad_list(capsys):
    from plan3d.cli import main

    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--tp", "1,x"])
    assert info.value.code == 2 and "comma-separated" in capsys.readouterr().err


def test_cli_from_run_refits_the_plans_spec(tmp_path, capsys):
    from plan3d.cli import main
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.plan import build_plan, save_plan
    from plan3d.specs.training import TrainingSpec

    base, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training = TrainingSpec(global_batch=16, precision="fp32")
    slower = scaled_compute(base, 0.4)
    dirs = []
    for i, layout in enumerate([Layout(dp=8), Layout(tp=2, pp=2, dp=2)]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        save_plan(build_plan(base, model, training, layout), run / "plan.json")
        measured = estimate(slower, model, training, layout).step_time_s
        (run / "summary.json").write_text(json.dumps({"step_time_s": measured, "ranks": []}))
        dirs.append((run, layout, measured))
    out = tmp_path / "refit.yaml"
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--from-run", str(dirs[0][0]), "--from-run", str(dirs[1][0]), "--out", str(out), "--json"])
    assert info.value.code in (0, None)
    assert json.loads(capsys.readouterr().out)["rows"][0]["quantity"] == "achieved FLOP/s multiplier"
    refit = load_cluster(str(out))
    for _, layout, measured in dirs:
        assert estimate(refit, model, training, layout).step_time_s == pytest.approx(measured, rel=0.02)


def test_refit_with_overheads_matches_every_run():
    from plan3d.calibrate import with_overheads
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout
    from plan3d.specs.training import TrainingSpec

    # A base whose compute and host overhead are of comparable size, so both are identifiable
    # (independent of what the bundled local-cpu spec holds today).
    base = load_cluster("local-cpu")
    base = base.model_copy(update={"gpu": base.gpu.model_copy(update={"compute_efficiency": ComputeEfficiency(
        max_fraction=0.75, half_work_flops=2e9, layer_overhead_s=1e-4)})})
    model, training = load_model("tiny-gpt"), TrainingSpec(global_batch=16, precision="fp32")
    layouts = [Layout(dp=8), Layout(tp=2, dp=4, micro_batch=2), Layout(pp=4, dp=2, micro_batch=1)]

    def predict(cluster):
        return [estimate(cluster, model, training, layout).step_time_s for layout in layouts]

    truth = predict(with_overheads(scaled_compute(base, 0.5), {"layer_overhead_s": 2e-3}))
    refit, fitted = refit_from_runs(base, predict, truth, fit_overhead=True)
    assert "layer_overhead_s" in fitted and fitted["rms_log_error"] < 0.02
    assert predict(refit) == pytest.approx(truth, rel=0.03)


# ---- issue 19: each fit's quality, an unusable fit marked, the spec's own name ------------------
def _fit_with_p2p(p2p_time_s):
    """A fit whose all-reduce samples follow alpha-beta exactly and whose p2p samples take `p2p_time_s(bytes)`."""
    samples = [dict(s, tier=0) for s in alpha_beta_samples(1e9, 1e-4) if s["op"] == "all_reduce"]
    samples += [dict(s, tier=0, time_s=p2p_time_s(s["bytes"])) for s in alpha_beta_samples(1e9, 0)
                if s["op"] == "p2p"]
    raw = {"device": "cpu", "gemm": synthetic_gemms(0.5, 1e5), "collectives": samples}
    return fit_measurements(load_cluster("local-cpu"), raw, "fp32")


def test_fit_quality_grades_each_term():
    from plan3d.calibrate import fit_quality, unusable_fits

    clean = fit_quality(_fit_with_p2p(lambda b: b / 2e9 + 3e-5), ["loopback"])
    assert {q["verdict"] for q in clean} == {"good"} and not unusable_fits(clean)
    assert {q["term"].split()[0] for q in clean if q["scope"] == "loopback"} == {"all_reduce", "p2p"}
    # time falling with size: no non-negative alpha-beta pair comes near it (the 90-99% p2p fit)
    bad = fit_quality(_fit_with_p2p(lambda b: 1e-2 / (1 + b / 4096)), ["loopback"])
    p2p = next(q for q in bad if q["term"].startswith("p2p"))
    assert p2p["verdict"] == "unusable" and p2p["rms_rel_error"] > 0.5
    lines = unusable_fits(bad)
    assert len(lines) == 1 and lines[0].startswith("loopback p2p") and "relative RMS error" in lines[0]
    assert next(q for q in bad if q["scope"] == "compute")["verdict"] == "good"


def test_calibrated_spec_has_its_own_name_machine_and_date(tmp_path):
    import datetime

    from plan3d.calibrate import calibrated_name, stamped

    base = load_cluster("local-cpu")
    fitted = calibrated_cluster(base, _fit_with_p2p(lambda b: b / 2e9 + 3e-5), "test", machine="bench-7")
    today = datetime.date.today()
    assert fitted.name == f"local-cpu-calibrated-bench-7-{today:%Y%m%d}" != base.name
    assert "bench-7" in fitted.description and today.isoformat() in fitted.description
    assert calibrated_name(fitted.name, "other") == f"local-cpu-calibrated-other-{today:%Y%m%d}"  # no chain
    assert stamped(base, "refit", machine="m1").name.startswith("local-cpu-calibrated-m1-")


def test_unusable_fits_head_the_written_spec(tmp_path):
    base = load_cluster("local-cpu")
    path = tmp_path / "cpu.yaml"
    write_calibrated_spec(base, {"gemm": []}, path, ["loopback p2p: relative RMS error 93% (worst 99%)"])
    assert "# WARNING: unusable fit, loopback p2p: relative RMS error 93%" in path.read_text()
    assert load_cluster(str(path)).name == base.name  # still a valid spec (marked, not broken)


def test_a_calibrated_name_from_an_odd_host_name_is_a_valid_spec_name():
    from pydantic import TypeAdapter

    from plan3d.calibrate import calibrated_name
    from plan3d.specs.base import Name

    name = calibrated_name("local-cpu", "my host\n::error::x")
    assert name.startswith("local-cpu-calibrated-my-host-error-x-")
    assert TypeAdapter(Name).validate_python(name) == name
