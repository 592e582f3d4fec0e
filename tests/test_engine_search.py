"""The search proposes only what the engine can run (issue 14): each bundled engine's `can_run`
as `search()` applies it, checked against the scalar truth `EngineSpec.layout_problems`."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.search import ENGINE_ZERO_PP_CODE, REASONS, Space, engine_space, search
from plan3d.vocab import RECOMPUTE_CODES
from plan3d.specs.schedule import schedule_names
from plan3d.specs.catalog import bundled_names, load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec
from cli_helpers import run_cli  # noqa: E402

SMALL = ["--cluster", "dgx-a100-80g", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "64"]
ZERO_PP_REASON = REASONS[ENGINE_ZERO_PP_CODE]


@pytest.fixture(scope="module")
def case():
    return load_cluster("dgx-a100-80g", nodes=2), load_model("llama3-8b"), TrainingSpec(global_batch=64)


@pytest.fixture(scope="module")
def free(case):
    """Every layout of the case, no engine, with the balanced split where pp*vpp does not divide
    the layers (the engines that take per-stage counts are searched with it by default)."""
    return search(*case, Space(uneven=True, schedules=schedule_names()))


def layouts(result) -> list:
    return [result.layout(i) for i in range(result.size)]


def key(layout) -> tuple:
    return tuple(sorted(layout.model_dump().items(), key=lambda kv: kv[0]))


@pytest.mark.parametrize("name", bundled_names("engine"))
def test_the_search_is_exactly_the_layouts_the_engine_can_run(case, free, name):
    """Mirror of the scalar rules: the engine's search holds every layout of the engine-free search
    that `layout_problems` accepts, and nothing else."""
    engine = load_engine(name)
    result = search(*case, engine=engine)
    assert result.size and result.engine is engine
    runnable = {key(lay) for lay in layouts(free) if not engine.layout_problems(lay) and lay.recompute != "partial"}
    assert {key(lay) for lay in layouts(result) if lay.recompute != "partial"} == runnable
    # partial recompute is kept where the engine's own memory needs some layers recomputed
    partial = [i for i in range(result.size) if result.layout(i).recompute == "partial"]
    assert all(result.metrics["recompute_layers"][i] >= 1 for i in partial)
    assert not partial or not engine.layout_problems(result.layout(partial[0]))


def test_megatron_deepspeed_has_no_interleaving_sp_or_zero2_3_with_pp(case):
    result = search(*case, engine=load_engine("megatron-deepspeed"))
    lay = result.layouts
    assert (lay["vpp"] == 1).all() and not lay["sequence_parallel"].any()
    assert not ((lay["pp"] > 1) & (lay["zero"] >= 2)).any()
    assert ((lay["pp"] == 1) & (lay["zero"] == 3)).any()  # ZeRO-3 stays allowed without pp
    assert set(result.orders) == {"tp-cp-ep-dp-pp"}


def test_the_zero_with_pp_rejections_are_counted_under_their_own_reason(case):
    engine = load_engine("megatron-deepspeed")
    result = search(*case, engine=engine)
    # the same narrowed space without the ZeRO-with-pp rule, searched without an engine
    unruled = search(*case, replace(engine_space(Space(), engine), zero_with_pp=(0, 1, 2, 3)))
    lay = unruled.layouts
    refused = int(((lay["pp"] > 1) & (lay["zero"] >= 2)).sum())
    assert refused > 0
    assert result.rejected[ENGINE_ZERO_PP_CODE] == refused
    assert result.size == unruled.size - refused
    assert result.considered == unruled.considered
    assert result.stats()["rejected"][ZERO_PP_REASON] == refused


def test_torchtitan_runs_tp_with_or_without_sequence_parallelism_and_no_zero1(case):
    result = search(*case, engine=load_engine("torchtitan"))
    lay = result.layouts
    assert (lay["tp"] > 1).any()
    assert not lay["sequence_parallel"][lay["tp"] > 1].all()  # torchtitan 0.3: enable_sequence_parallel
    assert not (lay["zero"] == 1).any() and (lay["zero"] == 2).any()
    assert result.rejected.get(ENGINE_ZERO_PP_CODE, 0) == 0  # it runs every stage it has with pp


def test_deepspeed_runs_tp1_only_and_no_selective_recompute(case):
    result = search(*case, engine=load_engine("deepspeed"))
    lay = result.layouts
    assert result.size and (lay["tp"] == 1).all()
    assert not (lay["recompute"] == RECOMPUTE_CODES["selective"]).any()


def test_megatron_lm_2021_runs_zero0_only(case):
    result = search(*case, engine=load_engine("megatron-lm-2021"))
    assert result.size and (result.layouts["zero"] == 0).all()
    assert (result.layouts["vpp"] > 1).any()  # interleaving it has


def test_the_search_predicts_as_the_engine_runs_it(case):
    """The metrics are the engine's estimate of each layout, not the cluster-only one."""
    engine = load_engine("megatron-deepspeed")
    result = search(*case, engine=engine)
    row = int(np.argmax(result.metrics["tokens_per_s"]))
    layout = result.layout(row)
    assert result.metrics["step_time_s"][row] == pytest.approx(estimate(*case, layout, engine).step_time_s, rel=1e-9)
    assert result.metrics["step_time_s"][row] != pytest.approx(estimate(*case, layout).step_time_s, rel=1e-3)


def test_engine_space_is_idempotent(case):
    for name in bundled_names("engine"):
        engine = load_engine(name)
        once = engine_space(Space(), engine)
        assert engine_space(once, engine) == once


# ---- through the CLI ---------------------------------------------------------------------------
def recommend_json(capsys, *args):
    code, out, err = run_cli(capsys, "recommend", *SMALL, "--top", "1000", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_recommend_megatron_deepspeed_lists_no_vpp_sp_or_zero2_3_with_pp(capsys):
    data = recommend_json(capsys, "--engine", "megatron-deepspeed")
    rows = [r["layout"] for r in data["top"]] + [a["layout"] for r in data["top"] for a in r["alternatives"]]
    assert data["engine"] == "megatron-deepspeed" and data["search"]["feasible"] >= len(rows) > 1
    assert all(r["vpp"] == 1 and not r["sequence_parallel"] for r in rows)
    assert not any(r["pp"] > 1 and r["zero"] >= 2 for r in rows)
    assert data["search"]["rejected"][ZERO_PP_REASON] > 0


def test_recommend_torchtitan_deepspeed_and_megatron_lm_2021(capsys):
    titan = [r["layout"] for r in recommend_json(capsys, "--engine", "torchtitan")["top"]]
    assert any(r["tp"] > 1 for r in titan)
    assert all(r["sequence_parallel"] for r in titan if r["tp"] > 1) and not any(r["zero"] == 1 for r in titan)
    deepspeed = [r["layout"] for r in recommend_json(capsys, "--engine", "deepspeed")["top"]]
    assert deepspeed and all(r["tp"] == 1 for r in deepspeed)
    old = [r["layout"] for r in recommend_json(capsys, "--engine", "megatron-lm-2021")["top"]]
    assert old and all(r["zero"] == 0 for r in old)


def test_recommend_default_engine_is_megatron_core_and_counts_no_refusal_without_zero2_3(capsys):
    data = recommend_json(capsys, "--zero", "0", "--zero", "1")
    assert data["engine"] == "megatron-core"
    assert ZERO_PP_REASON not in data["search"]["rejected"]


@pytest.mark.parametrize("args, words", [
    (["--engine", "megatron-deepspeed", "--vpp", "2"], ["megatron-deepspeed", "interleaved", "vpp 1"]),
    (["--engine", "megatron-lm-2021", "--zero", "3"], ["megatron-lm-2021", "ZeRO-3", "ZeRO 0"]),
    (["--engine", "megatron-deepspeed", "--zero", "2", "--pp", "2"], ["megatron-deepspeed", "pipeline", "0/1"]),
    (["--engine", "deepspeed", "--tp", "2"], ["deepspeed", "tensor parallelism", "tp 1"]),
    (["--engine", "deepspeed", "--recompute", "selective"], ["deepspeed", "selective", "none, full"]),
    (["--engine", "megatron-deepspeed", "--sequence-parallel"], ["megatron-deepspeed", "sequence parallelism"]),
    (["--engine", "torchtitan", "--zero", "1"], ["torchtitan", "ZeRO-1", "0/2/3"]),
    (["--engine", "megatron-deepspeed", "--order", "tp-cp-ep-pp-dp"], ["megatron-deepspeed", "tp-cp-ep-dp-pp"]),
    (["--engine", "megatron-lm-2021", "--uneven"], ["megatron-lm-2021", "--uneven", "evenly"]),
])
def test_a_fixed_knob_the_engine_cannot_run_is_one_line_naming_the_engine(capsys, args, words):
    code, out, err = run_cli(capsys, "recommend", *SMALL, *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in lines[0]


def test_the_same_knobs_pass_with_an_engine_that_runs_them(capsys):
    data = recommend_json(capsys, "--engine", "megatron-core", "--vpp", "2")
    assert data["top"] and all(r["layout"]["vpp"] == 2 for r in data["top"])


def test_megatron_deepspeed_searches_its_own_uneven_splits():
    """BLOOM's 70 layers do not divide 12 stages; Megatron-DeepSpeed splits them itself (5, 6 x 10, 5),
    so the search for that engine proposes pp 12 without --uneven, with that split."""
    from plan3d import ranking
    from plan3d.search import Space, search
    from plan3d.specs.catalog import load_cluster, load_engine, load_model
    from plan3d.specs.training import TrainingSpec

    bloom, training = load_model("bloom-176b"), TrainingSpec(global_batch=2048)
    cluster, space = load_cluster("dgx-a100-80g", 24), Space(max_micro_batch=2, min_pp=12, max_pp=12)
    result = search(cluster, bloom, training, space, engine=load_engine("megatron-deepspeed"))
    best = result.layout(ranking.rank(result)[0])
    assert best.pp == 12 and best.pp_layers == load_engine("megatron-deepspeed").default_split(70, 12, 1)
    with pytest.raises(LayoutError, match="megatron-core cannot build bloom-176b: position alibi"):
        search(cluster, bloom, training, space, engine=load_engine("megatron-core"))  # no ALiBi in Megatron-Core
