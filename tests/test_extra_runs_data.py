"""benchmarks/data/extra_runs.yaml, the held-out MoE / FP8 / context-parallel runs: the file loads,
every row cites a source with a location, every derived number recomputes from the row's own
numbers, and benchmarks/published.py predicts each row or excludes it with a reason, never
fitting on it.

The FLOP counts are written here again from Megatron-Core's `num_floating_point_operations`
(megatron/training/training.py, core_r0.8 - core_r0.11, and the causal version since commit
8873b55d6a, 2025-03-06), Narayanan et al. 2021's eq. (3) and the MS-AMP patch to Megatron-LM,
not imported from the code that produced the file. Rows measured in tokens/s or samples/s give
their step time without a FLOP count."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "extra_runs.yaml"
H100_PEAK_TFLOPS = 989.5  # MoE Parallel Folding, Sec. 4.1


@pytest.fixture(scope="module")
def data() -> dict:
    return yaml.safe_load(DATA.read_text())


@pytest.fixture(scope="module")
def rows(data) -> list[dict]:
    return data["runs"]


def flops_megatron_r011(m: dict, batch: int) -> float:
    """12 B s L h^2 [(1 + g/a + s/h) q/h + (f/h) k 3/2 + (f_shared/h) 3/2 + V/(2 L h)]."""
    h, s, layers, heads = m["hidden"], m["seq_len"], m["layers"], m["heads"]
    moe = m.get("moe") or {}
    q_over_h = m["head_dim"] * heads / h
    attention = (1 + m["kv_heads"] / heads + s / h) * q_over_h
    mlp = (moe.get("expert_ffn_hidden") or m["ffn_hidden"]) / h * moe.get("top_k", 1) * 1.5
    shared = moe.get("shared_ffn_hidden", 0) / h * 1.5
    return 12 * batch * s * layers * h * h * (attention + mlp + shared + m["vocab"] / (2 * layers * h))


def flops_megatron_causal(m: dict, batch: int) -> float:
    """3 (fwd + 2 bwd) x 2 FLOPs per multiply-add, per token: the MLPs of dense and MoE layers,
    Q/K/V/O projections, causal QK^T and AV (half of s^2), and the logits."""
    h, s, layers = m["hidden"], m["seq_len"], m["layers"]
    moe = m.get("moe") or {}
    moe_layers = sum(1 for i in range(layers) if moe and i >= moe["first_dense_layers"] and i % moe["every"] == 0)
    dense_layers = layers - moe_layers
    q, kv = m["head_dim"] * m["heads"], m["head_dim"] * m["kv_heads"]
    mlp_macs = 3 * h * (m["ffn_hidden"] * dense_layers
                        + (moe.get("expert_ffn_hidden") or 0) * moe.get("top_k", 0) * moe_layers
                        + moe.get("shared_ffn_hidden", 0) * moe_layers)
    attention_macs = layers * (h * (q + 2 * kv) + q * h + 2 * q * s / 2)
    return 6 * batch * s * (mlp_macs + attention_macs + h * m["vocab"])


def flops_megatron_hw_96(m: dict, batch: int) -> float:
    """Narayanan et al. 2021 eq. (3): 96 B s L h^2 (1 + s/6h + V/16Lh), the recompute forward counted."""
    h, s, layers = m["hidden"], m["seq_len"], m["layers"]
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + m["vocab"] / (16 * layers * h))


def flops_msamp_72(m: dict, batch: int) -> float:
    """MS-AMP-Examples gpt3/Megatron-LM.patch without recompute: 24 * 3 B s L h^2 (1 + s/6h + V/16Lh)."""
    return flops_megatron_hw_96(m, batch) * 3 / 4


FLOPS = {"megatron_core_r011": flops_megatron_r011, "megatron_core_2025": flops_megatron_causal,
         "megatron_hw_recompute_96": flops_megatron_hw_96}


def achieved_tflops(measured: dict) -> float:
    for key in ("tflops_per_gpu", "tflops_per_gpu_forced_balance"):
        if key in measured:
            return measured[key]
    return measured["mfu_pct"] / 100 * H100_PEAK_TFLOPS


def expected_derived(row: dict) -> dict:
    """Every number the row's `derived` block may hold, recomputed from its own fields."""
    m, meas, batch = row["model"], row["measured"], row["batch"]
    n = row["hardware"]["num_gpus"]
    out = {}
    counting = row.get("flops_counting")
    if counting in FLOPS:
        flops = FLOPS[counting](m, batch["global_batch_seqs"])
        if "iteration_time_s" in meas:
            out["tflops_per_gpu_from_step"] = flops / (n * meas["iteration_time_s"]) / 1e12
        else:
            out["iteration_time_s"] = flops / (n * achieved_tflops(meas) * 1e12)
        if "mfu_pct" in meas:
            out["model_tflops_per_gpu"] = achieved_tflops(meas)
        if "tflops_per_gpu_dropless" in meas:
            out["iteration_time_s_dropless"] = flops / (n * meas["tflops_per_gpu_dropless"] * 1e12)
        other = row.get("flops_counting_other")
        if other in FLOPS:
            out["iteration_time_s_other_count"] = (FLOPS[other](m, batch["global_batch_seqs"])
                                                   / (n * achieved_tflops(meas) * 1e12))
    if "tokens_per_s_per_gpu" in meas:
        out["iteration_time_s"] = batch["global_batch_tokens"] / (n * meas["tokens_per_s_per_gpu"])
    if "samples_per_s" in meas:
        out["iteration_time_s"] = batch["global_batch_seqs"] / meas["samples_per_s"]
        out["tflops_per_gpu_from_samples"] = (flops_msamp_72(m, batch["global_batch_seqs"])
                                              / (n * out["iteration_time_s"]) / 1e12)
    if "gpu_hours_per_trillion_tokens" in meas:
        seconds_per_token_per_gpu = meas["gpu_hours_per_trillion_tokens"] * 3600 / 1e12
        out["tokens_per_s_per_gpu"] = 1 / seconds_per_token_per_gpu
        if n:
            out["iteration_time_s"] = seconds_per_token_per_gpu * batch["global_batch_seqs"] * m["seq_len"] / n
    if "gpu_hours" in meas:
        out["mean_iteration_time_s_both_phases"] = meas["gpu_hours"] * 3600 / n / meas["steps"]
    return out


def test_the_file_loads_and_ids_are_unique(rows):
    assert len(rows) >= 40
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_every_row_cites_a_source_with_a_location(data, rows):
    for source in data["sources"].values():
        assert source["title"] and source["url"].startswith("http") and source["how_read"]
    for row in rows:
        assert row["source"]["ref"] in data["sources"], row["id"]
        assert len(row["source"]["location"]) > 20, row["id"]
        assert row["source"]["evidence"].startswith(("primary_text", "primary_config", "primary_image", "figure_reading",
                                                     "secondary")), row["id"]
        assert isinstance(row["unverified"], list), row["id"]


def test_derived_numbers_recompute_from_the_rows_own_numbers(rows):
    checked = 0
    for row in rows:
        derived = {k: v for k, v in (row.get("derived") or {}).items() if not k.startswith("formula")}
        expected = expected_derived(row)
        assert set(derived) <= set(expected), f"{row['id']}: derived {set(derived) - set(expected)} has no check"
        for key, value in derived.items():
            assert value == pytest.approx(expected[key], rel=2e-3), f"{row['id']}: {key}"
            checked += 1
    assert checked >= 60


def test_the_2025_flop_convention_reproduces_the_zoo_tflops_from_its_step_times(rows):
    """The zoo's H100 table gives both step time and TFLOPS: the causal count must join them."""
    pairs = [(r["measured"]["tflops_per_gpu"], r["derived"]["tflops_per_gpu_from_step"]) for r in rows
             if "tflops_per_gpu_from_step" in (r.get("derived") or {})]
    assert len(pairs) >= 5
    for published, from_step in pairs:
        assert from_step == pytest.approx(published, rel=0.01)


def test_layouts_and_batches_are_consistent(rows):
    for row in rows:
        par, batch, m = row["parallelism"], row["batch"], row["model"]
        assert batch["global_batch_tokens"] == batch["global_batch_seqs"] * m["seq_len"], row["id"]
        if row.get("excluded"):
            continue
        assert par["tp"] * par["pp"] * par["dp"] * par["cp"] == row["hardware"]["num_gpus"], row["id"]
        if par.get("pp_layers"):
            assert sum(par["pp_layers"]) == m["layers"], row["id"]
            assert len(par["pp_layers"]) == par["pp"] * (par.get("vpp") or 1), row["id"]
        if row["training"]["precision"] == "fp8" and row.get("pair_of"):
            assert any(r["id"] == row["pair_of"] and r["training"]["precision"] == "bf16" for r in rows), row["id"]


def test_there_are_moe_fp8_and_context_parallel_rows(rows):
    assert sum(1 for r in rows if r["model"].get("moe")) >= 40
    assert sum(1 for r in rows if r["training"]["precision"] == "fp8") >= 3
    assert sum(1 for r in rows if (r["parallelism"].get("cp") or 1) > 1) >= 4


def test_there_are_dense_fully_sharded_and_dense_fp8_rows(rows):
    dense = [r for r in rows if not r["model"].get("moe")]
    sharded = [r for r in dense if "zero-3" in str(r["parallelism"].get("zero")).lower()
               or "full_shard" in str(r["parallelism"].get("zero")).lower()]
    assert len(sharded) >= 40
    assert all(r["training"].get("framework") for r in sharded)
    assert sum(1 for r in dense if r["training"]["precision"] == "fp8" and r.get("pair_of")) >= 3


# ---- the benchmark's use of the rows --------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import published
    import published_runs
    return published, published_runs


def rows_of(data: dict, rows: list[dict], role: str) -> list[dict]:
    """The rows of the sources with `role` (held-out unless a source says `role: calibration`)."""
    roles = {name: src.get("role", "held-out") for name, src in data["sources"].items()}
    return [r for r in rows if roles.get(r["source"]["ref"], "held-out") == role]


def test_each_row_becomes_a_run_or_an_exclusion_with_a_reason(bench, data, rows):
    _, runs_mod = bench
    runs, excluded, _ = runs_mod.load_extra(DATA)
    calibration, calibration_excluded, _ = runs_mod.load_extra(DATA, role="calibration")
    assert len(runs) + len(excluded) == len(rows_of(data, rows, "held-out"))
    assert len(calibration) + len(calibration_excluded) == len(rows_of(data, rows, "calibration"))
    assert calibration and all(r.engine == "deepspeed-0.19" and r.knobs["zero"] == 3 for r in calibration)
    excluded = excluded + calibration_excluded
    assert all(why.strip() for _, why in excluded)
    by_id = {r["id"]: r for r in rows}
    for run_id, why in excluded:
        row = by_id[run_id]
        etp = row["parallelism"].get("etp", row["parallelism"].get("tp"))
        if etp is not None and etp != row["parallelism"]["tp"]:
            assert "expert tensor parallel" in why
    bf16_twins = {r["pair_of"] for r in rows if r.get("pair_of")}
    for run in runs:
        assert run.measured_s > 0 and math.isfinite(run.measured_s)
        assert (run.model.moe is not None or run.knobs["cp"] > 1 or run.training.precision == "fp8"
                or run.knobs["zero"] == 3 or run.id in bf16_twins), run.id


def test_held_out_rows_are_predicted_without_fitting(bench, data, rows, monkeypatch):
    published, _ = bench

    def no_fit(*args, **kwargs):
        raise AssertionError("held-out rows must never be fitted")

    monkeypatch.setattr(published, "fit", no_fit)
    monkeypatch.setattr(published, "nelder_mead", no_fit)
    rep = published.held_out(published.bundled_params(), DATA)
    assert len(rep["rows"]) + len(rep["excluded"]) == len(rows_of(data, rows, "held-out"))
    for row in rep["rows"]:
        assert row["predicted_s"] > 0 and math.isfinite(row["error_pct"])
    for source, s in rep["sources"].items():
        assert s["runs"] == sum(1 for r in rep["rows"] if r["source"] == source)


def test_a_layout_plan3d_cannot_express_is_excluded_with_its_reason(bench, rows):
    _, runs_mod = bench
    base = next(r for r in rows if r["id"] == "liu25-t3-mixtral8x22b-mcore")
    too_wide = dict(base, parallelism=dict(base["parallelism"], ep=16))  # dp*cp = 8
    with pytest.raises(runs_mod.Excluded, match="ep=16 must divide dp\\*cp=8"):
        runs_mod.extra_to_run(too_wide)
    unknown_gpu = dict(base, hardware=dict(base["hardware"], gpu="TPU v5p"))
    with pytest.raises(runs_mod.Excluded, match="no bundled cluster spec"):
        runs_mod.extra_to_run(unknown_gpu)
    assert runs_mod.extra_to_run(base).knobs["ep"] == 4
