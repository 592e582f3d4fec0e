"""Expert tensor parallelism in the search (issue 29, MoE Parallel Folding): ETP1 beside etp = tp
where the engine runs it, `recommend --etp N`, and every searched layout predicted as `estimate`
predicts it."""
from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import layout_problems
from plan3d.search import Space, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec

SPACE = Space(max_micro_batch=1, max_vpp=1, zero=(1,), recompute=("none",), orders=("tp-cp-ep-dp-pp",))


@pytest.fixture(scope="module")
def case():
    return load_cluster("dgx-h100", 1), load_model("mixtral-8x7b"), TrainingSpec(global_batch=64, seq_len=4096)


@pytest.fixture(scope="module")
def folded(case):
    return search(*case, SPACE, engine=load_engine("megatron-core"))


def rows(result):
    return [result.layout(i) for i in range(result.size)]


def test_etp1_is_searched_beside_etp_tp_and_lets_ep_exceed_dp_cp(folded):
    layouts = rows(folded)
    etp1 = [lay for lay in layouts if lay.tp > 1 and lay.expert_tp == 1]
    assert etp1 and any(lay.expert_tp == lay.tp > 1 for lay in layouts)
    # Megatron-Core folds ep * etp into a stage's tp * cp * dp ranks: at tp2 dp4, ETP1 allows ep8
    assert any(lay.ep > lay.dp * lay.cp for lay in etp1)
    assert all((lay.tp * lay.cp * lay.dp) % (lay.ep * lay.expert_tp) == 0 for lay in layouts)


def test_every_searched_etp_layout_is_predicted_as_estimate_predicts_it(case, folded):
    engine = load_engine("megatron-core")
    for i in range(folded.size):
        lay = folded.layout(i)
        if lay.etp is None:
            continue
        est = estimate(*case, lay, engine)
        assert folded.metrics["step_time_s"][i] == pytest.approx(est.step_time_s, rel=1e-9)
        assert folded.metrics["peak_memory_bytes"][i] == pytest.approx(est.peak_memory_bytes, rel=1e-9)
        assert not layout_problems(lay, case[1], case[2], case[0].world_size) and not engine.layout_problems(lay)
        assert folded.find(lay) == i


def test_etp_is_not_searched_where_it_cannot_run(case):
    titan = search(*case, Space(max_micro_batch=1, max_vpp=1, zero=(2,), recompute=("none",)),
                   engine=load_engine("torchtitan"))
    assert "etp" not in titan.layouts or bool(np.all(titan.layouts["etp"] == titan.layouts["tp"]))
    cluster, _, training = case
    dense = search(cluster, load_model("llama3-8b"), training, SPACE, engine=load_engine("megatron-core"))
    assert all(lay.etp is None for lay in rows(dense))
    with pytest.raises(LayoutError, match="--etp 2: .*splits experts over tp only"):
        search(*case, Space(etp_fixed=2), engine=load_engine("torchtitan"))
    with pytest.raises(LayoutError, match="--etp 1: llama3-8b is dense"):  # not a silent tp = 1 filter
        search(cluster, load_model("llama3-8b"), training, Space(etp_fixed=1), engine=load_engine("megatron-core"))


def test_a_fixed_etp_keeps_only_layouts_with_it_and_refuses_one_that_splits_no_expert(case):
    fixed = search(*case, Space(max_micro_batch=1, max_vpp=1, zero=(1,), recompute=("none",), etp_fixed=1),
                   engine=load_engine("megatron-core"))
    assert fixed.size and all(lay.expert_tp == 1 for lay in rows(fixed))
    cluster, model, training = case
    odd_ffn = model.model_copy(update={"moe": model.moe.model_copy(update={"expert_ffn_hidden": 1000})})
    odd = search(load_cluster("dgx-h100", 4), odd_ffn, training,
                 Space(max_micro_batch=1, max_vpp=1, zero=(1,), recompute=("none",), etp_fixed=16),
                 engine=load_engine("megatron-core"))  # ep2 x etp16 folds into tp8 dp4; 1000 % 16 != 0
    assert any("etp does not divide the expert FFN" in reason for reason in odd.rejected_by_reason())


def test_recommend_shows_the_etp_column_and_takes_the_flag(capsys):
    args = ["recommend", "-c", "dgx-h100", "--nodes", "2", "-m", "mixtral-8x7b", "--global-batch", "64",
            "--seq-len", "4096", "--max-micro-batch", "1", "--top", "3", "--engine", "megatron-core"]
    code, out, err = run_cli(capsys, *args, "--etp", "1")
    assert code == 0, err
    header = next(line for line in out.splitlines() if "┃ #" in line)
    assert "etp" in header
    code, _, err = run_cli(capsys, *args, "--etp", "0")
    assert code == 2 and "--etp must be >= 1" in err
