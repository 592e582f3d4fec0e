"""Error bands (plan3d/cost/bands.py) and the ranking that respects them (plan3d/ranking.py):
band arithmetic on hand-made error sets, the choice of the region a band borrows from, the
widening by stated priors, and the band rule of the `expected` ranking."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from plan3d import ranking
from plan3d.cost import bands
from plan3d.cost.bands import AXIS_BY_NAME, NOISE, BandData, MeasuredRun, Region, band_of, load_band_data
from plan3d.search import search
from plan3d.specs.catalog import engine_for, load_cluster, load_model
from plan3d.specs.training import TrainingSpec

HOPPER = dict(engine="eng-a", gpu="hopper", sharding="zero0-2", cp=False, moe=False, fp8=False)


def run(i: int, error_pct: float, source: str = "s1", gpus: int = 64, **region) -> MeasuredRun:
    return MeasuredRun(id=f"r{i}-{source}", source=source, gpus=gpus, error_pct=error_pct, how="left-out",
                       **(HOPPER | region))


def data(*runs: MeasuredRun) -> BandData:
    return BandData(generated_by="test", runs=tuple(runs))


def region(**changes) -> Region:
    return Region(**(HOPPER | changes))


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), written out."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    return xs[lo] + (pos - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def noisy(log_low: float, log_high: float) -> tuple[float, float]:
    """A quantile band stretched to hold 0 and widened by a measurement's noise, as errors (e)."""
    return (math.expm1(min(log_low, 0) + math.log1p(-NOISE)), math.expm1(max(log_high, 0) + math.log1p(NOISE)))


def test_a_measured_region_gets_the_central_80_percent_of_its_errors_and_the_noise():
    errors = [-20.0, -10.0, 0.0, 10.0, 30.0]
    band = band_of(region(), 64, data(*(run(i, e) for i, e in enumerate(errors))))
    logs = [math.log1p(e / 100) for e in errors]
    assert band.validated and band.relaxed == () and band.runs == 5
    low, high = noisy(quantile(logs, 0.1), quantile(logs, 0.9))  # q10: 0.4 of the way from -20% to -10%
    assert band.low == pytest.approx(low, rel=1e-12) and band.high == pytest.approx(high, rel=1e-12)
    # the measured step of a 10 s prediction: 10 / (1 + high) .. 10 / (1 + low)
    assert band.step_band(10.0) == pytest.approx((10 / (1 + band.high), 10 / (1 + band.low)))


def test_no_band_is_narrower_than_the_sources_noise_and_every_band_holds_the_prediction():
    band = band_of(region(), 64, data(*(run(i, 0.0) for i in range(6))))
    assert band.low == pytest.approx(-NOISE) and band.high == pytest.approx(NOISE)
    biased = band_of(region(), 64, data(*(run(i, 10.0 + i) for i in range(6))))  # always too slow
    assert biased.low == pytest.approx(-NOISE) and biased.high > 0.14


def test_too_few_runs_borrow_the_engines_other_gpu_widened_by_the_stated_prior():
    errors = [-5.0, -2.0, 0.0, 2.0, 5.0]
    measured = [run(i, e, gpu="ampere") for i, e in enumerate(errors)]
    band = band_of(region(), 64, data(*measured, run(9, 50.0)))  # one hopper run: below MIN_RUNS
    logs = [math.log1p(e / 100) for e in errors + [50.0]]  # the pool: the engine's runs on any GPU
    lo, hi = AXIS_BY_NAME["gpu"].prior_pct
    assert band.relaxed == ("gpu",) and not band.validated and band.runs == 6
    low, high = noisy(quantile(logs, 0.1), quantile(logs, 0.9))
    assert math.log1p(band.low) == pytest.approx(math.log1p(low) + math.log1p(lo / 100), rel=1e-12)
    assert math.log1p(band.high) == pytest.approx(math.log1p(high) + math.log1p(hi / 100), rel=1e-12)
    assert "runs of eng-a on hopper" in band.extrapolated[0]


def test_a_feature_is_let_go_of_by_the_region_without_it_and_the_engine_last():
    same_engine = [run(i, 1.0) for i in range(5)]  # eng-a, ZeRO 0-2
    other_engine = [run(10 + i, 40.0, engine="eng-b", sharding="zero3") for i in range(5)]  # eng-b, ZeRO-3
    band = band_of(region(sharding="zero3"), 64, data(*same_engine, *other_engine))
    assert band.relaxed == ("sharding",)  # not ("engine",): another engine's errors are the last resort
    assert band.sources == ("s1",) and band.runs == 5


def test_a_feature_the_region_lacks_is_never_borrowed():
    """A dense bf16 prediction never borrows MoE or fp8 runs: only the engine and the GPU can go."""
    moe_runs = [run(i, 0.0, moe=True) for i in range(5)]
    band = band_of(region(), 64, data(*moe_runs, *(run(10 + i, 0.0, engine="eng-b") for i in range(5))))
    assert band.relaxed == ("engine",)


def test_more_gpus_than_twice_the_largest_run_is_extrapolated_on_scale():
    measured = data(*(run(i, 0.0, gpus=512) for i in range(5)))
    assert band_of(region(), 1024, measured).validated
    band = band_of(region(), 1025, measured)
    assert band.relaxed == ("scale",) and "512" in band.extrapolated[0]


def test_without_data_every_feature_is_a_prior():
    band = band_of(region(cp=True), 8, data())
    assert set(band.relaxed) == {"cp", "gpu", "engine"} and band.runs == 0
    expected_low = sum(math.log1p(AXIS_BY_NAME[a].prior_pct[0] / 100) for a in band.relaxed)
    assert math.log1p(band.low) == pytest.approx(expected_low)


def test_the_bundled_errors_load_and_validate_the_regions_they_measure():
    measured = load_band_data()
    assert len(measured.runs) >= 50
    for r in measured.runs:
        reg = Region(**{k: getattr(r, k) for k in bands.REGION_FIELDS})
        same = [x for x in measured.runs if Region(**{k: getattr(x, k) for k in bands.REGION_FIELDS}) == reg]
        band = band_of(reg, r.gpus, measured)
        assert band.validated == (len(same) >= bands.MIN_RUNS and r.gpus <= 2 * max(x.gpus for x in same))


# ---- the ranking ----------------------------------------------------------------------------------
def test_the_band_rule_by_hand():
    """Row 0 validated (cost 10, band 9-11). Row 1 extrapolated, cost 8 but band 5-12: it does not
    win beyond the bands (12 > 9), so its key becomes row 0's. Row 2 extrapolated, cost 7, band
    6-8.5: its slow end 8.5 is below row 0's fast end 9, so it keeps its cost."""
    cost = np.array([10.0, 8.0, 7.0])
    fast, slow = np.array([9.0, 5.0, 6.0]), np.array([11.0, 12.0, 8.5])
    tier = np.array([0, 1, 1])
    keys = ranking.banded_keys(cost, fast, slow, tier, np.ones(3, dtype=bool))
    assert keys.tolist() == [10.0, 10.0, 7.0]


@pytest.fixture(scope="module")
def seed():
    """GPT-3 175B on 512 A100 with megatron-core: ZeRO-3 layouts are extrapolated on one more feature."""
    cluster = load_cluster("dgx-a100-80g")
    return search(cluster, load_model("gpt3-175b"), TrainingSpec(global_batch=1536), engine=engine_for(None, cluster))


def test_expected_ranking_puts_no_layout_above_a_less_extrapolated_one_it_does_not_beat_beyond_the_bands(seed):
    m = seed.metrics
    rows = ranking.rank(seed)[: seed.feasible_count]
    tier, low, high = m["band_tier"][rows], m["step_band_low_s"][rows], m["step_band_high_s"][rows]
    assert len(np.unique(tier)) > 1  # the case has layouts of two tiers
    for t in np.unique(tier)[1:]:
        lower_low = np.where(tier < t, low, np.inf)
        later = np.append(np.minimum.accumulate(lower_low[::-1])[::-1][1:], np.inf)  # min over later rows
        assert (high[tier == t] < later[tier == t]).all()


def test_a_faster_zero3_layout_is_passed_over_and_named(seed):
    order = ranking.rank(seed)
    first = int(order[0])
    passed = ranking.passed_over(seed, order)
    assert passed, "the case has a ZeRO-3 layout predicted faster than #1"
    m = seed.metrics
    assert all(m["tokens_per_s"][r] > m["tokens_per_s"][first] for r in passed)
    assert all(m["band_tier"][r] > m["band_tier"][first] for r in passed)
    optimistic = ranking.rank(seed, ranking="optimistic")
    assert seed.layout(int(optimistic[0])).zero == 3  # ranked by the fast end, the wide band wins


@pytest.mark.parametrize("mode, column", [("optimistic", "step_band_low_s"), ("conservative", "step_band_high_s")])
def test_optimistic_and_conservative_rank_by_one_end_of_the_band(seed, mode, column):
    rows = ranking.rank(seed, ranking=mode)[: seed.feasible_count]
    ends = seed.metrics[column][rows]
    assert (np.diff(ends) >= -ends[:-1] * 2 * ranking.TIE_PPM).all()


def test_an_unknown_ranking_is_refused(seed):
    with pytest.raises(Exception, match="--ranking"):
        ranking.rank(seed, ranking="median")


# ---- what the commands show ---------------------------------------------------------------------
SEED = ["--cluster", "dgx-a100-80g", "--model", "gpt3-175b"]


def cli_json(capsys, *args) -> dict:
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_estimate_json_carries_the_band_and_the_three_utilisations(capsys):
    d = cli_json(capsys, "estimate", *SEED, "--tp", "8", "--pp", "8", "--dp", "8", "--zero", "1", "--recompute", "full",
                 "--sequence-parallel")
    lo, hi = d["step_time_s_band"]
    assert lo < d["step_time_s"] < hi
    assert d["validated"] is False and d["region"]["extrapolated"]
    # full recompute: HFU = 4/3 x non-causal MFU but for the logits, which are not recomputed
    assert d["mfu"] < d["mfu_noncausal"] < d["hfu"] < 4 / 3 * d["mfu_noncausal"]


def test_recommend_json_rows_carry_bands_and_name_what_was_passed_over(capsys):
    d = cli_json(capsys, "recommend", *SEED, "--top", "3")
    assert d["ranking"] == "expected"
    first = d["top"][0]
    assert {"step_time_s_band", "validated", "region"} <= set(first)
    assert first["layout"]["zero"] != 3
    assert d["passed_over"] and all(p["layout"]["zero"] == 3 for p in d["passed_over"])
    assert all(p["tokens_per_s"] > first["tokens_per_s"] for p in d["passed_over"])
    optimistic = cli_json(capsys, "recommend", *SEED, "--top", "1", "--ranking", "optimistic")
    assert optimistic["top"][0]["layout"]["zero"] == 3


def test_check_conservative_judges_min_mfu_at_the_slow_end(capsys):
    job = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "gpt3-175b-seed.yaml"
    d = cli_json(capsys, "check", job)
    est = d["estimate"]
    slow_mfu = est["mfu"] * est["step_time_s"] / est["step_time_s_band"][1]
    threshold = (slow_mfu + est["mfu"]) / 2  # met by the prediction, not by its slow end
    assert run_cli(capsys, "check", job, "--min-mfu", f"{threshold:.4f}")[0] == 0
    code, out, _ = run_cli(capsys, "check", job, "--min-mfu", f"{threshold:.4f}", "--conservative")
    assert code == 1 and f"MFU {slow_mfu:.1%}" in out


def test_a_bad_ranking_flag_is_one_line_exit_2(capsys):
    code, _, err = run_cli(capsys, "recommend", *SEED, "--ranking", "median")
    assert code == 2 and "--ranking 'median'" in err and "Traceback" not in err
