"""Pipeline schedules as data (plan3d.specs.schedule, bundled/pipeline_schedules.yaml): each
formula on a case computed by hand, the layout and engine rules that read the table, and the
search, cost and memory models that use it."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.cost.estimate import estimate
from plan3d.cost.memory import model_state_bytes
from plan3d.cost.pipeline import pipeline_s
from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems
from plan3d.search import Space, search
from plan3d.specs import schedule as schedules
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec

P, T, W, M = 4, 3.0, 1.0, 8  # stages, per-micro-batch time F + B + W, weight-gradient time, micro-batches


def bubble(name: str, vpp: int) -> float:
    code = np.array([schedules.code_of(name)])
    stage = np.full((P, 1), T)
    _, idle = pipeline_s(stage, np.ones((P, 1)), np.array([M]), np.array([vpp]), 1.0, np.full((P, 1), W),
                         schedules.bubble_weights(code))
    return float(idle[0])


@pytest.mark.parametrize("name, vpp, by_hand", [
    ("1f1b", 1, (P - 1) * T),  # (p - 1) t
    ("interleaved-1f1b", 2, (P - 1) * T / 2),  # (p - 1) t / v
    ("zb1p", 2, (P - 1) * (T - 2 * W) / 2),  # ZB-H1: (p - 1)(F + B - W) = (p - 1)(t - 2W), over v chunks
    ("zbv", 2, 0.0),  # ZB-V: (p - 1)(F + B - 2W) per chunk, zero at F = B = W
    ("dualpipev", 2, (P - 1) * (T - W) / 2),  # (PP/2 - 1)(F&B + B - 3W) over PP = 2p chunks
    ("dualpipe", 1, 0.5 * (P - 1) * (T - W)),  # the bidirectional pipe halves it
])
def test_fill_and_drain_of_each_schedule(name, vpp, by_hand):
    assert bubble(name, vpp) == pytest.approx(by_hand)


def test_in_flight_micro_batches_of_each_schedule():
    codes = np.array([schedules.code_of(n) for n in ("1f1b", "interleaved-1f1b", "zbv", "dualpipev", "dualpipe")])
    vpp = np.array([1, 2, 2, 2, 1])
    first = schedules.in_flight(codes, 4, 0, vpp, 100)
    assert first.tolist() == [4, (2 * 3 + 1 * 4 + 1) / 2, 4, 4.5, 5]  # p; Megatron's warm-up; p; p + 1/2; p + 1
    last = schedules.in_flight(codes, 4, 3, vpp, 100)
    assert last.tolist() == [1, (0 + 4 + 1) / 2, 4, 4.5, 5]  # the V schedules hold as much on every rank
    assert schedules.in_flight(codes, 4, 0, vpp, 3).tolist() == [3] * 5  # never more than the step's micro-batches


def test_v_shaped_schedules_place_the_first_and_last_stage_on_rank_0():
    assert [schedules.stage_rank(s, 4, True) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [schedules.stage_rank(s, 4, False) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert schedules.per_rank([1, 2, 3, 4, 5, 6, 7, 8], 4, True) == [9, 9, 9, 9]


def test_a_layout_names_a_schedule_that_runs_its_chunks():
    assert Layout(pp=2, vpp=2, schedule="interleaved-1f1b").schedule is None  # the vpp default: one name per job
    assert Layout(pp=2, vpp=2, schedule="zbv").pipeline_schedule == "zbv"
    assert Layout(pp=2, vpp=3).pipeline_schedule == "interleaved-1f1b"
    with pytest.raises(ValueError, match="zbv schedule runs vpp=2 model chunks per pipeline rank, not vpp=3"):
        Layout(pp=2, vpp=3, schedule="zbv")
    with pytest.raises(ValueError, match="needs pp > 1"):
        Layout(schedule="zb1p")
    with pytest.raises(ValueError, match="choose from 1f1b, interleaved-1f1b"):
        Layout(pp=2, schedule="gpipe")


def test_dualpipev_needs_two_micro_batches_per_pipeline_rank():
    model, training = load_model("llama3-8b"), TrainingSpec(global_batch=16)
    short = Layout(pp=4, vpp=2, dp=2, schedule="dualpipev", micro_batch=1)  # 8 micro-batches, 8 stages: enough
    assert not layout_problems(short, model, training, 8)
    fewer = short.model_copy(update={"micro_batch": 2})  # 4 micro-batches for 8 stages
    assert layout_problems(fewer, model, training, 8) == [
        "the pipeline schedule needs at least 8 micro-batches per step, the layout has 4: lower the micro-batch "
        "size or dp, or choose another schedule"]


def test_engines_run_the_schedules_their_profiles_list():
    zbv = Layout(tp=2, pp=2, dp=2, vpp=2, schedule="zbv", zero=2, sequence_parallel=True)
    assert not load_engine("torchtitan").layout_problems(zbv)
    assert load_engine("megatron-core").layout_problems(zbv.model_copy(update={"zero": 1})) == [
        "megatron-core has no zbv pipeline schedule; it runs 1f1b, interleaved-1f1b: set the schedule (and vpp) to "
        "one of them"]
    assert any("no zbv pipeline schedule" in p for p in load_engine("torchtitan-compile").layout_problems(zbv))
    runtime = load_engine("plan3d-runtime")
    assert not runtime.layout_problems(zbv.model_copy(update={"zero": 1, "sequence_parallel": False, "tp": 1,
                                                             "dp": 4}))
    assert any("cannot run ZeRO-3 under the zbv schedule" in p
               for p in runtime.layout_problems(Layout(pp=2, dp=4, vpp=2, schedule="zbv", zero=3)))


def test_a_legacy_profile_without_interleaving_keeps_single_chunk_schedules():
    spec = load_engine("torchtitan")
    legacy = spec.can_run.model_validate(spec.can_run.model_dump() | {"interleaving": False})
    assert legacy.schedules == ["1f1b"] and legacy.max_chunks == 1


@pytest.fixture(scope="module")
def small():
    return load_cluster("dgx-h100", nodes=4), load_model("llama3-8b"), TrainingSpec(global_batch=512)


def test_the_search_tries_the_engines_schedules_and_only_those(small):
    titan = search(*small, Space(min_pp=2, max_pp=4, max_micro_batch=2), engine=load_engine("torchtitan"))
    found = {titan.layout(i).pipeline_schedule for i in range(titan.size)}
    assert found == {"1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev"}
    assert all(titan.layout(i).vpp == 2 for i in range(titan.size) if titan.layout(i).pipeline_schedule == "zbv")
    assert {titan.layout(i).zero for i in range(titan.size)} == {0, 2, 3}  # and torchtitan's ZeRO stages
    mcore = search(*small, Space(min_pp=2, max_pp=4, max_micro_batch=2), engine=load_engine("megatron-core"))
    assert {mcore.layout(i).pipeline_schedule for i in range(mcore.size)} == {"1f1b", "interleaved-1f1b"}
    only = search(*small, Space(min_pp=2, max_pp=4, max_micro_batch=2, schedules=("zbv",)),
                  engine=load_engine("torchtitan"))
    assert only.size and {only.layout(i).pipeline_schedule for i in range(only.size)} == {"zbv"}
    with pytest.raises(LayoutError, match="megatron-core has no zbv pipeline schedule"):
        search(*small, Space(schedules=("zbv",)), engine=load_engine("megatron-core"))


def test_the_searched_schedules_cost_what_estimate_says(small):
    titan = search(*small, Space(min_pp=4, max_pp=4, max_micro_batch=1, zero=(2,), recompute=("none",)),
                   engine=load_engine("torchtitan"))
    for i in range(titan.size):
        layout = titan.layout(i)
        one = estimate(*small, layout, load_engine("torchtitan"))
        assert titan.metrics["step_time_s"][i] == pytest.approx(one.step_time_s, rel=1e-9), layout.short()
        assert titan.metrics["peak_memory_bytes"][i] == pytest.approx(one.peak_memory_bytes, rel=1e-9)


def test_zero_bubble_schedules_shorten_the_bubble_in_the_estimate(small):
    engine = load_engine("torchtitan")
    base = dict(pp=4, dp=8, vpp=2, zero=2)
    times = {name: estimate(*small, Layout(**base, schedule=name), engine).time_s["bubble"]
             for name in ("interleaved-1f1b", "zb1p", "dualpipev", "zbv")}
    assert times["interleaved-1f1b"] > times["dualpipev"] > times["zb1p"] > times["zbv"] >= 0


def test_v_shaped_schedules_put_the_output_layer_on_rank_0(small):
    model, training = small[1], small[2]
    loop, vee = Layout(pp=4, dp=8, vpp=2), Layout(pp=4, dp=8, vpp=2, schedule="zbv")
    weights = {name: [model_state_bytes(model, training, lay, r)["weights"] for r in range(4)]
               for name, lay in (("loop", loop), ("v", vee))}
    assert weights["v"][0] > weights["loop"][0] and weights["v"][3] < weights["loop"][3]
    assert sum(weights["v"]) == pytest.approx(sum(weights["loop"]))  # the same parameters, placed elsewhere
    assert estimate(*small, vee, load_engine("torchtitan")).worst_pp_rank == 0


def test_paired_forward_backward_hides_the_all_to_alls_where_the_engine_overlaps_them():
    cluster, model = load_cluster("dgx-h100", nodes=8), load_model("mixtral-8x7b")
    training = TrainingSpec(global_batch=256)
    layout = Layout(pp=4, dp=16, ep=8, vpp=2, schedule="dualpipev", zero=2)
    titan = load_engine("torchtitan")
    plain = estimate(cluster, model, training, layout, titan).time_s
    overlapping = titan.model_copy(update={"runs_as": titan.runs_as.model_copy(
        update={"f_b_overlap": True, "f_b_comm_sm_share": 0.15})})
    paired = estimate(cluster, model, training, layout, overlapping).time_s
    assert plain["ep_comm"] > 0
    assert paired["compute"] == pytest.approx(plain["compute"] / 0.85)  # the GEMMs run on 85% of the SMs
    assert paired["ep_comm"] == pytest.approx(max(plain["ep_comm"] - (paired["compute"] + paired["recompute"]), 0))
    interleaved = layout.model_copy(update={"schedule": None})  # no paired chunks: nothing hidden
    assert (estimate(cluster, model, training, interleaved, overlapping).time_s
            == estimate(cluster, model, training, interleaved, titan).time_s)


def test_the_runtime_refuses_tied_embeddings_under_a_v_shaped_schedule():
    from plan3d.plan import build_plan
    from plan3d.run.launch import runtime_problems

    cluster, training = load_cluster("local-cpu"), TrainingSpec(global_batch=16)
    tiny = load_model("tiny-gpt")
    tied, untied = (tiny.model_copy(update={"tied_embeddings": flag}) for flag in (True, False))
    vee = Layout(pp=2, dp=2, vpp=2, schedule="zbv")
    assert any("both ends sit on rank 0" in p for p in runtime_problems(build_plan(cluster, tied, training, vee)))
    assert not any("both ends" in p for p in runtime_problems(build_plan(cluster, untied, training, vee)))
    loop = vee.model_copy(update={"schedule": "zb1p"})
    assert not any("both ends" in p for p in runtime_problems(build_plan(cluster, tied, training, loop)))
