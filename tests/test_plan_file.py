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
