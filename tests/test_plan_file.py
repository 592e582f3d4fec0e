"""The Plan JSON file: round trip, digest against hand edits, plans from older versions."""
from __future__ import annotations

import json

import pytest

from plan3d.errors import SpecError
from plan3d.layout import Layout
from plan3d.plan import DIGESTED, build_plan, digest_of, load_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec


@pytest.fixture
def plan_path(tmp_path):
    plan = build_plan(load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=16),
                      Layout(tp=2, pp=2, dp=2))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return path


def test_a_saved_plan_loads_back_equal(plan_path):
    plan = load_plan(str(plan_path))
    assert plan.layout == Layout(tp=2, pp=2, dp=2) and plan.digest == plan.specs_digest()


def test_a_hand_edit_of_the_specs_is_caught(plan_path):
    data = json.loads(plan_path.read_text())
    data["layout"]["micro_batch"] = 2
    plan_path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="digest does not match"):
        load_plan(str(plan_path))


def test_a_plan_written_before_a_spec_gained_a_defaulted_field_still_loads(plan_path):
    data = json.loads(plan_path.read_text())
    # as an older plan3d wrote it: no per-collective costs, no host_overlap (both added later)
    del data["cluster"]["network"][0]["collectives"]
    del data["cluster"]["gpu"]["compute_efficiency"]["host_overlap"]
    data["digest"] = digest_of({k: data[k] for k in DIGESTED})
    plan_path.write_text(json.dumps(data))
    plan = load_plan(str(plan_path))
    assert plan.cluster.gpu.compute_efficiency.host_overlap is True  # the default fills in
    assert plan.cluster.network[0].collectives == {}


def test_an_uneven_plan_round_trips_through_its_file(tmp_path, capsys):
    """recommend --uneven --out writes pp_layers as a JSON array; loading reads it back (strictly)."""
    from cli_helpers import run_cli

    model = tmp_path / "m7.yaml"
    model.write_text("name: m7\nlayers: 7\nhidden: 64\nheads: 4\nvocab: 256\nseq_len: 32\ndefault_global_batch: 16\n")
    plan_path = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "recommend", "-c", "local-cpu", "-m", model, "--tp", "2", "--pp", "2", "--dp", "2",
                           "--uneven", "--precision", "fp32", "--top", "1", "--out", plan_path)
    assert code == 0, err
    plan = load_plan(str(plan_path))
    assert plan.layout.pp_layers is not None and sum(plan.layout.pp_layers) == 7
    code, out, err = run_cli(capsys, "emit", "megatron", plan_path)
    assert code == 0, err
    first = out.split().index("--decoder-first-pipeline-num-layers")
    assert out.split()[first + 1] == str(plan.layout.pp_layers[0])
    job = tmp_path / "job.yaml"
    job.write_text(f"cluster: local-cpu\nmodel: {model}\ntraining: {{global_batch: 16, precision: fp32}}\n"
                   "layout: {tp: 2, pp: 2, dp: 2, pp_layers: [4, 3]}\n")
    code, out, err = run_cli(capsys, "check", job)
    assert "valid array" not in out + err and code in (0, 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(job.read_text().replace("[4, 3]", "[4, \"3\"]"))
    code, _, err = run_cli(capsys, "check", bad)
    assert code == 2 and "pp_layers" in err


# ---- red team of issue 19: saving never renames over a special file ------------------------------
def test_saving_over_a_fifo_is_refused_and_leaves_it_a_fifo(plan_path, tmp_path):
    import os
    import stat

    from plan3d.errors import OutputError

    plan = load_plan(str(plan_path))
    for target in (tmp_path / "out.json", tmp_path / "tmp-in-the-way.json"):
        fifo = target if target.name == "out.json" else target.with_suffix(".json.tmp")
        os.mkfifo(fifo)
        with pytest.raises(OutputError, match="FIFO"):
            save_plan(plan, target)
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(IsADirectoryError):
        save_plan(plan, tmp_path)


def test_recommend_out_onto_a_fifo_is_one_error_line(tmp_path, capsys):
    import os
    import stat

    from cli_helpers import run_cli

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    code, out, err = run_cli(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--global-batch", "16",
                             "--out", fifo)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "FIFO" in err and str(fifo) in err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not (tmp_path / "plan.json.tmp").exists()


# ---- issue 13: the estimate and the rank map as typed records ------------------------------------
@pytest.fixture
def estimated_plan_path(tmp_path):
    from plan3d.cost.estimate import estimate

    cluster, model, training = load_cluster("local-cpu"), load_model("tiny-gpt"), TrainingSpec(global_batch=16)
    layout = Layout(tp=2, pp=2, dp=2, recompute="selective")
    path = tmp_path / "estimated.json"
    save_plan(build_plan(cluster, model, training, layout, estimate(cluster, model, training, layout).to_dict()), path)
    return path


def test_a_loaded_plan_holds_typed_records_and_writes_back_the_same_file(estimated_plan_path, plan_path):
    from plan3d.plan import Estimate, RankMapRecord
    from plan3d.vocab import MEMORY_TERMS, TIME_TERMS

    plan = load_plan(str(estimated_plan_path))
    assert isinstance(plan.estimate, Estimate) and isinstance(plan.rankmap, RankMapRecord)
    assert tuple(plan.estimate.time_s) == TIME_TERMS and tuple(plan.estimate.memory_bytes) == MEMORY_TERMS
    assert plan.estimate.step_time_s == pytest.approx(sum(plan.estimate.time_s.values()))
    assert plan.rankmap.world_size == 8 and len(plan.rankmap.ranks) == 8
    assert sorted(m for g in plan.rankmap.groups["tp"] for m in g) == list(range(8))
    for path in (estimated_plan_path, plan_path):
        assert load_plan(str(path)).model_dump_json(indent=1) == path.read_text()  # same bytes, same digest


def test_a_plan_without_an_estimate_holds_none_and_writes_an_empty_section(plan_path):
    plan = load_plan(str(plan_path))
    assert plan.estimate is None
    assert json.loads(plan_path.read_text())["estimate"] == {}
    assert plan.digest == plan.specs_digest()


def test_an_older_estimate_without_the_optional_fields_keeps_its_shape(estimated_plan_path):
    data = json.loads(estimated_plan_path.read_text())
    for key in ("mfu", "fits", "tiers", "provenance", "worst_pp_rank"):  # as a plan3d before them wrote it
        del data["estimate"][key]
    data["estimate"]["from_a_newer_plan3d"] = [1, "two"]
    data["digest"] = digest_of({k: v for k, v in data.items() if k != "digest"})
    estimated_plan_path.write_text(json.dumps(data))
    plan = load_plan(str(estimated_plan_path))
    assert plan.estimate.mfu is None and not plan.estimate.given("mfu") and not plan.estimate.given("fits")
    written = plan.model_dump(mode="json")
    assert written["estimate"] == data["estimate"]  # nothing added, the unknown key kept
    assert plan.specs_digest() == data["digest"]


def test_the_records_are_typed_not_dicts(estimated_plan_path):
    plan = load_plan(str(estimated_plan_path))
    assert plan.rankmap.gpus_per_node == plan.gpus_per_node == plan.cluster.gpus_per_node
    assert plan.rankmap.ranks[3]["rank"] == 3 and plan.estimate.step_time_s > 0
    with pytest.raises(TypeError):
        plan.estimate["step_time_s"]  # attributes only: no dict-style fallback


def test_a_bad_estimate_value_names_its_field(estimated_plan_path):
    data = json.loads(estimated_plan_path.read_text())
    data["estimate"]["time_s"]["compute"] = -1.0
    data["digest"] = digest_of({k: v for k, v in data.items() if k != "digest"})
    estimated_plan_path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"estimate\.time_s\.compute"):
        load_plan(str(estimated_plan_path))
