"""Predictions follow the engine (issue 30 item 3): a plan emitted for another engine than the one it
was predicted for is re-estimated under the target profile; one that would not fit there is refused."""
from __future__ import annotations

import re

import pytest

from plan3d.cost.estimate import estimate
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import build_plan, save_plan
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec
from tests.emit_helpers import run_cli

TRAINING = TrainingSpec(global_batch=64, precision="bf16")


def _planned(engine: str, model: str = "llama3-8b", **layout) -> "object":
    """A plan as `recommend --engine ENGINE --out` writes it: the layout's estimate under ENGINE."""
    cluster, spec, lay = load_cluster("dgx-h100", nodes=4), load_model(model), Layout(**layout)
    profile = load_engine(engine)
    return build_plan(cluster, spec, TRAINING, lay, estimate(cluster, spec, TRAINING, lay, profile).to_dict(),
                      engine=profile)


def _note(notes: list[str]) -> str:
    found = [n for n in notes if "this layout is predicted at" in n]
    assert len(found) == 1, notes
    return found[0]


def test_a_torchtitan_plan_through_the_megatron_emitter_gives_megatrons_prediction():
    plan = _planned("torchtitan", tp=2, dp=16, zero=3, micro_batch=1)
    ours = estimate(plan.cluster, plan.model, plan.training, plan.layout, load_engine("megatron-core"))
    note = _note(emit_megatron(plan).notes)
    assert note.startswith("the plan's predictions are for engine torchtitan (step "
                           f"{plan.estimate.step_time_s:.2f} s")
    assert f"under megatron-core this layout is predicted at step {ours.step_time_s:.2f} s" in note
    change = float(re.search(r"step [\d.]+ s \(([+-][\d.]+)%\)", note).group(1))
    assert change == pytest.approx((ours.step_time_s / plan.estimate.step_time_s - 1) * 100, abs=0.06)
    assert "peak" in note and "GiB (" in note  # the memory delta


def test_the_plans_own_engine_gets_no_reestimate():
    plan = _planned("megatron-core", tp=2, dp=16, micro_batch=1)
    assert not [n for n in emit_megatron(plan).notes if "this layout is predicted at" in n]


def test_a_plan_with_no_engine_is_estimated_under_the_target():
    plan = build_plan(load_cluster("dgx-h100", nodes=4), load_model("llama3-8b"), TRAINING, Layout(tp=2, dp=16))
    note = _note(emit_megatron(plan).notes)
    assert note.startswith("the plan has no predictions (no engine); under megatron-core")


def test_a_layout_that_would_not_fit_under_the_target_is_refused_naming_the_fix():
    # a 70B at tp=8 pp=1 ZeRO-3 fits torchtitan's FSDP; under Megatron's ZeRO-1 it cannot
    plan = _planned("torchtitan", model="llama3-70b", tp=8, dp=4, zero=3, micro_batch=1, recompute="full")
    assert plan.estimate.fits
    cut = plan.model_copy(update={"layout": plan.layout.model_copy(update={"zero": 1})})
    with pytest.raises(InfeasibleError, match=r"would run out of memory.*plan3d recommend --engine megatron-core"):
        emit_megatron(cut)


def test_a_plan_with_no_engine_that_would_not_fit_is_emitted_with_the_warning():
    plan = build_plan(load_cluster("dgx-h100", nodes=4), load_model("llama3-70b"), TRAINING,
                      Layout(tp=8, dp=4, zero=1, micro_batch=1, recompute="full"))
    assert "IT WOULD RUN OUT OF MEMORY under megatron-core" in _note(emit_megatron(plan).notes)


def test_a_megatron_plan_through_torchtitan_is_reestimated_too():
    plan = _planned("megatron-core", tp=2, dp=16, zero=3, micro_batch=1)  # Megatron-FSDP: torchtitan runs it as FSDP
    note = _note(emit_torchtitan(plan).notes)
    assert "the plan's predictions are for engine megatron-core" in note and "under torchtitan" in note


def test_the_cli_prints_the_reestimate_and_exits_1_on_the_refusal(tmp_path, capsys):
    plan = _planned("torchtitan", tp=2, dp=16, zero=3, micro_batch=1)
    save_plan(plan, tmp_path / "plan.json")
    assert run_cli(["emit", "megatron", str(tmp_path / "plan.json")]) == 0
    assert "under megatron-core this layout is predicted at" in capsys.readouterr().err
    # a Megatron-FSDP plan that fits; torchtitan's FSDP2 keeps more per GPU and would not
    big = _planned("megatron-core", model="llama3-70b", tp=1, dp=32, zero=3, micro_batch=2, recompute="full")
    assert big.estimate.fits
    save_plan(big, tmp_path / "big.json")
    assert run_cli(["emit", "torchtitan", str(tmp_path / "big.json")]) == 1
    err = capsys.readouterr().err
    assert "plan3d recommend --engine torchtitan" in err and "Traceback" not in err
