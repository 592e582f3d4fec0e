"""What each engine runs with ep > 1 (tp, ZeRO stage, rank order), applied alike by `estimate`, the
search and the emitters; and the all-to-alls an engine hides behind its shared experts."""
from __future__ import annotations

import numpy as np
import pytest

from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.search import ENGINE_EP_CODE, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec

TRAINING = TrainingSpec(global_batch=256)


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")


@pytest.mark.parametrize("engine, layout, says", [
    ("torchtitan", Layout(tp=2, dp=8, ep=2, zero=3, sequence_parallel=True), "keeps each expert whole"),
    ("deepspeed-0.19", Layout(tp=2, dp=8, ep=2, zero=1), "keeps each expert whole"),
    ("torchtitan", Layout(dp=16, ep=2, zero=1), "runs ep > 1 with ZeRO {2, 3} only"),
    ("megatron-core", Layout(pp=2, dp=8, ep=2, zero=1, order="tp-cp-ep-pp-dp"), "only with ep = cp (1)"),
])
def test_engine_refuses_its_ep_layouts_by_name(mixtral, engine, layout, says):
    spec = load_engine(engine)
    assert any(says in p for p in spec.layout_problems(layout, mixtral))
    with pytest.raises(LayoutError, match=engine):
        estimate(load_cluster("dgx-h100", 2), mixtral, TRAINING, layout, spec)


@pytest.mark.parametrize("engine, layout", [
    ("torchtitan", Layout(dp=16, ep=2, zero=3)),
    ("deepspeed-0.19", Layout(dp=16, ep=8, zero=1)),
    ("megatron-core", Layout(pp=2, dp=8, ep=2, zero=1)),  # the default order, tp-cp-ep-dp-pp
    ("megatron-core", Layout(tp=2, dp=8, ep=2, zero=1, sequence_parallel=True)),
])
def test_engine_runs_the_ep_layouts_it_accepts(mixtral, engine, layout):
    assert load_engine(engine).layout_problems(layout, mixtral) == []


@pytest.mark.parametrize("engine", ["torchtitan", "megatron-core"])
def test_search_drops_what_the_engine_refuses_and_counts_it(mixtral, engine):
    spec = load_engine(engine)
    result = search(load_cluster("dgx-h100", 2), mixtral, TRAINING, engine=spec)
    lay = result.layouts
    assert result.rejected.get(ENGINE_EP_CODE, 0) > 0
    assert (lay["ep"] > 1).any()
    for i in np.flatnonzero(lay["ep"] > 1)[:400]:
        assert spec.layout_problems(result.layout(int(i)), mixtral) == []


def _shared_overlap(engine, on: bool):
    runs_as = engine.runs_as.model_copy(update={"shared_expert_overlap": on})
    return engine.model_copy(update={"runs_as": runs_as})


def test_shared_experts_hide_the_all_to_alls_up_to_their_own_time():
    """An engine profile with `shared_expert_overlap` (Megatron-Core's --moe-shared-expert-overlap;
    the bundled profile does not credit it, see engine_specs/megatron-core.yaml): the exposed
    all-to-all time of a shared-expert model shrinks, but never below zero; a model without shared
    experts is unaffected."""
    cluster = load_cluster("dgx-h100", 32)
    megatron = _shared_overlap(load_engine("megatron-core"), True)
    layout = Layout(dp=256, ep=32, zero=1, recompute="full")  # does not fit; the times still compare
    deepseek = load_model("deepseek-v3")
    train = TrainingSpec(global_batch=1024)
    hidden = estimate(cluster, deepseek, train, layout, megatron).time_s["ep_comm"]
    exposed = estimate(cluster, deepseek, train, layout, _shared_overlap(megatron, False)).time_s["ep_comm"]
    assert 0 <= hidden < exposed
    mixtral = load_model("mixtral-8x7b")
    plain = Layout(dp=256, ep=8, zero=1)
    assert (estimate(cluster, mixtral, train, plain, megatron).time_s["ep_comm"]
            == estimate(cluster, mixtral, train, plain, _shared_overlap(megatron, False)).time_s["ep_comm"] > 0)


def test_megatrons_pp_dp_order_needs_ep_equal_cp_for_dense_models_too():
    """initialize_model_parallel builds the expert groups for every model: with the order
    tp-cp-ep-pp-dp and pp > 1 it asserts dp*cp/ep == dp, so cp > 1 at ep = 1 fails as well."""
    megatron = load_engine("megatron-core")
    llama = load_model("llama3-8b")
    cp2 = Layout(tp=2, pp=2, dp=4, cp=2, sequence_parallel=True, order="tp-cp-ep-pp-dp")
    assert any("only with ep = cp (2)" in p for p in megatron.layout_problems(cp2, llama))
    assert megatron.layout_problems(cp2.model_copy(update={"order": "tp-cp-ep-dp-pp"}), llama) == []
    assert megatron.layout_problems(cp2.model_copy(update={"cp": 1, "dp": 8}), llama) == []
    result = search(load_cluster("dgx-h100", 4), llama, TrainingSpec(global_batch=64, seq_len=32768),
                    engine=megatron)
    lay = result.layouts
    pp_dp = np.array([o.endswith("-dp") for o in result.orders])[lay["order"]]
    assert (lay["cp"] > 1).any() and not (pp_dp & (lay["pp"] > 1) & (lay["cp"] != lay["ep"])).any()


def test_megatron_refuses_expert_biases_with_tp_everywhere(mixtral):
    """TransformerConfig: experts with biases need expert tensor parallel 1 (= tp here)."""
    biased = mixtral.model_copy(update={"bias": True, "name": "mixtral-biased"})
    megatron = load_engine("megatron-core")
    layout = Layout(tp=2, dp=8, ep=8, zero=1, sequence_parallel=True)
    assert any("experts with biases" in p for p in megatron.layout_problems(layout, biased))
    assert megatron.layout_problems(layout, mixtral) == []
    result = search(load_cluster("dgx-h100", 2), biased, TRAINING, engine=megatron)
    assert len(result.layouts["tp"]) and (result.layouts["tp"] == 1).all()
    assert (search(load_cluster("dgx-h100", 2), mixtral, TRAINING, engine=megatron).layouts["tp"] > 1).any()
