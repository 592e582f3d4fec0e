"""Issue 19, the output side: nothing printed or written is NaN, infinite or absurd; a CI gate never
passes on such a prediction; names cannot inject workflow commands; huge searches are refused fast.

The schema bounds (tests/test_specs_bad_input.py) stop most extreme values at load time; these tests
build specs past them (`model_copy` does not validate) to check the defence behind them."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cli.common import make_training
from plan3d.cost.estimate import estimate
from plan3d.cost.finite import MAX_STEP_S, NonFinitePrediction, is_finite, require_finite
from plan3d.layout import Layout
from plan3d.render.units import json_text, nonfinite_path, printable
from plan3d.search import SearchBudgetError, Space, nodes_to_fit, search
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.cluster import MAX_NODES, ClusterSpec

REPO = Path(__file__).resolve().parents[1]

SEED = Layout(tp=8, pp=8, dp=8, micro_batch=1, zero=1, recompute="selective", sequence_parallel=True)


def with_tier(cluster: ClusterSpec, index: int, **values) -> ClusterSpec:
    """`cluster` with network tier `index` changed, past the schema's bounds."""
    network = list(cluster.network)
    network[index] = network[index].model_copy(update=values)
    return cluster.model_copy(update={"network": network})


@pytest.fixture
def seed_specs():
    model = load_model("gpt3-175b")
    return load_cluster("dgx-a100-80g", 64, None), model, make_training(global_batch=1536)


@pytest.mark.parametrize("values, named", [
    ({"latency_us": 1e308}, "latency_us 1e+308"),
    ({"efficiency": 1e-320}, "efficiency"),
])
def test_estimate_refuses_a_non_finite_prediction_naming_the_input(seed_specs, values, named):
    cluster, model, training = seed_specs
    with pytest.raises(NonFinitePrediction, match=re.escape(named)) as err:
        estimate(with_tier(cluster, 1, **values), model, training, SEED)
    assert "\n" not in str(err.value) and "physical value" in str(err.value)


def test_search_refuses_a_non_finite_prediction(seed_specs):
    cluster, model, training = seed_specs
    with pytest.raises(NonFinitePrediction, match="latency_us"):
        search(with_tier(cluster, 1, latency_us=1e300), model, training, Space(max_micro_batch=2, max_vpp=2))


def test_a_finite_but_absurd_step_time_is_refused(seed_specs):
    cluster, model, training = seed_specs
    slow = with_tier(cluster, 1, latency_us=MAX_STEP_S * 1e8)  # finite, but years per hop
    with pytest.raises(NonFinitePrediction, match=re.escape(f"latency_us 1e+20 gives a step time above {MAX_STEP_S:g} s")):
        estimate(slow, model, training, SEED)


def test_require_finite_passes_physical_values_and_looks_into_nested_terms(seed_specs):
    cluster, model, training = seed_specs
    require_finite({"step_time_s": np.array([1.0, 2.0]), "time_s": {"compute": 0.5}}, cluster, model, training)
    with pytest.raises(NonFinitePrediction, match="compute time"):
        require_finite({"step_time_s": 1.0, "time_s": {"compute": math.nan}}, cluster, model, training)
    with pytest.raises(NonFinitePrediction):
        require_finite({"tokens_per_s": -1.0}, cluster, model, training)
    assert not is_finite([1.0, math.inf]) and is_finite([-1.0]) and not is_finite([-1.0], non_negative=True)


def test_json_text_is_strict_and_names_the_field():
    assert json.loads(json_text({"a": [1.0, 2]})) == {"a": [1.0, 2]}
    assert nonfinite_path({"a": {"b": [1.0, math.nan]}}) == "a.b.1"
    with pytest.raises(NonFinitePrediction, match=r"estimate\.step_time_s"):
        json_text({"estimate": {"step_time_s": math.inf}})


def test_printable_keeps_a_name_on_one_line():
    text = printable("gpt\n::error::owned\r\x1b[31m")
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert text.startswith("gpt\\n::error::owned")


def _evil_model(tmp_path):
    import yaml

    spec = yaml.safe_load((REPO / "model_specs" / "gpt3-175b.yaml").read_text())  # wherever pytest runs from
    spec["name"] = "gpt3\n::error::owned"
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("fmt", ["github", "text"])
def test_check_output_cannot_start_a_workflow_command_from_a_name(capsys, tmp_path, fmt):
    job = tmp_path / "job.yaml"
    job.write_text(f"cluster: dgx-a100-80g\nnodes: 64\nmodel: {_evil_model(tmp_path)}\n"
                   "training: {global_batch: 1536}\nlayout: {tp: 8, pp: 8, dp: 8, zero: 1, recompute: selective}\n")
    code, out, err = run_cli(capsys, "check", job, "--format", fmt)
    _refused_name(code, out, err)


def _refused_name(code: int, out: str, err: str) -> None:
    """A name with a newline is refused where the spec is read (plan3d.specs.base.Name): one escaped
    error line, and no output line of its own."""
    # in github format the problem is the annotation (stdout), printed once; stderr keeps the verdict
    assert code == 2 and err.startswith("error: ") and "name" in out + err and "\\n::error::owned" in out + err, err
    assert not any(line.strip().startswith("::error::owned") for line in (out + err).splitlines())


def test_recommend_title_cannot_start_a_workflow_command(capsys, tmp_path):
    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-a100-80g", "-m", _evil_model(tmp_path), "--top", "1",
                             "--max-vpp", "1", "--max-micro-batch", "1")
    _refused_name(code, out, err)


@pytest.fixture
def extreme_latency(monkeypatch):
    """Every cluster's outer tier at 1e308 us per hop, as if the schema had let it through."""
    original = ClusterSpec.tiers

    def tiers(self):
        out = original(self)
        return out[:-1] + [out[-1].model_copy(update={"latency_s": 1e302, "collectives": ()})]

    monkeypatch.setattr(ClusterSpec, "tiers", tiers)


def test_check_never_passes_on_a_non_finite_prediction(capsys, extreme_latency):
    code, out, err = run_cli(capsys, "check", str(REPO / "examples" / "jobs" / "gpt3-175b-seed.yaml"), "--json")
    assert code == 2 and json.loads(out)["ok"] is False
    assert len(err.strip().splitlines()) == 1 and "latency" in err
    code, out, _ = run_cli(capsys, "check", str(REPO / "examples" / "jobs" / "gpt3-175b-seed.yaml"), "--format", "github")
    assert code == 2 and out.startswith("::error file=") and "PASS" not in out


@pytest.mark.parametrize("command", [
    ["estimate", "-c", "dgx-a100-80g", "-m", "gpt3-175b", "--tp", "8", "--pp", "8", "--json"],
    ["recommend", "-c", "dgx-a100-80g", "-m", "gpt3-175b", "--json", "--max-vpp", "2"],
])
def test_commands_print_no_nan_and_exit_2(capsys, extreme_latency, command):
    code, out, err = run_cli(capsys, *command)
    assert code == 2 and "NaN" not in out and "Infinity" not in out
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


# ---- the search budget and the bounds of numeric flags ------------------------------------------
def test_a_huge_search_is_refused_with_how_to_narrow_it(capsys):
    code, _, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-70b", "--nodes", "1000000",
                           "--global-batch", "1000000000")
    assert code == 2 and "narrow it" in err and "--tp" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, says", [
    (["--max-nodes", "2000000"], "1,000,000"),
    (["--vpp", "100000000000000000000"], "--vpp"),
    (["--max-vpp", "100000000"], "--max-vpp"),
    (["--max-micro-batch", "100000000"], "--max-micro-batch"),
    (["--top", "100000000000000000000"], "--top"),
])
def test_numeric_flags_out_of_bounds_are_one_line(capsys, flags, says):
    code, _, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-70b", *flags)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "pydantic" not in err


def test_shape_budget_is_checked_before_the_grid_is_built(seed_specs):
    cluster, model, training = seed_specs
    with pytest.raises(SearchBudgetError, match="shapes"):
        search(cluster, model, training, Space(max_micro_batch=10**8))


def test_nodes_to_fit_stays_inside_the_node_bound(seed_specs):
    cluster, model, training = seed_specs
    big = cluster.with_size(nodes=MAX_NODES // 2)
    assert nodes_to_fit(big, model, training) in (None, MAX_NODES)


def test_json_when_no_layout_is_valid_at_all(capsys):
    """No valid layout, even or uneven: a JSON answer with an empty Pareto front and exit 1 (was a KeyError)."""
    code, out, err = run_cli(capsys, "recommend", "-c", "local-cpu", "-m", "tiny-gpt", "--json",
                             "--gpus-per-node", "4096", "--nodes", "1")
    assert code == 1 and json.loads(out)["pareto_front"] == [] and "no valid layout" in err
