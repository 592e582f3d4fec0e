"""The MoE token dispatcher (RunsAs.ep_dispatcher, `--ep-dispatcher`): the all-to-all of every
routed copy, or DeepEP / HybridEP's hierarchical dispatch that sends a token over the network
once per other node holding one of its experts (plan3d.cost.moe.remote_nodes_per_token,
hierarchical_dispatch_s), with DeepSeek-V3's node-limited routing (docs/cost-model.md,
"Mixture of experts")."""
from __future__ import annotations

from math import comb
from types import SimpleNamespace

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost.comm import layout_links
from plan3d.cost.context import MOE_IMBALANCE
from plan3d.cost.estimate import estimate
from plan3d.cost.moe import remote_nodes_per_token
from plan3d.emit.megatron_moe import dispatcher_args
from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.search import Space, evaluate, evaluate_scalar, layout_at, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.engine import EngineSpec
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec


def routing(experts, top_k, groups=1, group_top_k=1):
    return SimpleNamespace(experts=experts, top_k=top_k, router_groups=groups, router_group_top_k=group_top_k)


def test_remote_nodes_by_hand_for_unlimited_routing():
    """Qwen3-235B-like (128 experts, top-8) on 4 nodes: another node holds 32 experts and gets none
    of a token's 8 copies with probability C(96, 8) / C(128, 8), so 3 x (1 - that) other nodes."""
    expected = 3 * (1 - comb(96, 8) / comb(128, 8))
    got = remote_nodes_per_token(routing(128, 8), np.array([1.0, 4.0]))
    assert got[0] == 0.0 and got[1] == pytest.approx(expected)
    assert 2.7 < expected < 2.75  # against 8 x 3/4 = 6 copies leaving the node without the dedup


def test_node_limited_routing_by_hand():
    """DeepSeek-V3 (256 experts top-8, 8 groups, the best 4) on 8 nodes: a node is among a token's
    4 with probability 4/8, and then misses its 8 copies (spread over 4 x 32 experts) with
    probability C(96, 8) / C(128, 8); with groups that are not the nodes, the unlimited count."""
    limited = routing(256, 8, 8, 4)
    expected = 7 * 4 / 8 * (1 - comb(96, 8) / comb(128, 8))
    assert remote_nodes_per_token(limited, np.array([8.0]))[0] == pytest.approx(expected)
    unlimited = 7 * (1 - comb(224, 8) / comb(256, 8))
    assert remote_nodes_per_token(limited, np.array([4.0]))[0] == pytest.approx(
        3 * (1 - comb(192, 8) / comb(256, 8)))
    assert remote_nodes_per_token(routing(256, 8), np.array([8.0]))[0] == pytest.approx(unlimited)
    assert expected < 4 < unlimited


@pytest.fixture(scope="module")
def mixtral_case():
    model = load_model("mixtral-8x7b")
    return load_cluster("dgx-h100", nodes=8), model, TrainingSpec(global_batch=256)


def test_deepep_across_nodes_by_hand(mixtral_case):
    """ep 8 over 8 nodes (tp 8, one member per node): one dispatch is the slower of the network part (tokens x remote
    nodes x h x 2 bytes over the GPU's NIC share) and the NVLink part (every copy for another GPU),
    plus one latency per other node; 4 of them per layer and micro-batch, none recomputed."""
    cluster, model, training = mixtral_case
    layout = Layout(tp=1, pp=1, dp=64, ep=8, zero=1)
    links = layout_links(1, 1, 64, layout.order, tuple(cluster.tiers()), 8, 1, 8)["ep"]
    assert links.domains == 1  # ep 8 at tp 1: one node, DeepEP's intranode path = the all-to-all
    alltoall = estimate(cluster, model, training, layout, load_engine("megatron-core"))
    deepep_engine = load_engine("megatron-core").with_ep_dispatcher("deepep")
    assert estimate(cluster, model, training, layout, deepep_engine).time_s["ep_comm"] == pytest.approx(
        alltoall.time_s["ep_comm"])

    wide = Layout(tp=8, pp=1, dp=8, ep=8, zero=1, sequence_parallel=True)
    link = layout_links(8, 1, 8, wide.order, tuple(cluster.tiers()), 8, 1, 8)["ep"]
    assert link.domains == 8 and link.tier == "ib-ndr"
    est = estimate(cluster, model, training, wide, deepep_engine)
    k, h, seq = model.moe.top_k, model.hidden, model.seq_len
    token_bytes = seq / 8 * MOE_IMBALANCE * h * 2  # the sequence-parallel shard
    remote = remote_nodes_per_token(routing(model.moe.experts, k), np.array([8.0]))[0]
    one = max(token_bytes * remote / link.outer_bytes_per_s, token_bytes * k * 7 / 8 / link.inner_bytes_per_s)
    one += 7 * link.cost("all_gather")[1]
    assert est.ep_dispatcher == "deepep"
    assert est.time_s["ep_comm"] == pytest.approx(256 // 8 * model.layers * 4 * one, rel=1e-9)
    plain = estimate(cluster, model, training, wide, load_engine("megatron-core"))
    # one expert per node: a token's 2 copies go to 2 nodes either way, nothing to deduplicate
    assert plain.ep_dispatcher == "alltoall" and plain.time_s["ep_comm"] == pytest.approx(est.time_s["ep_comm"],
                                                                                          rel=0.05)


def test_deepep_sends_deepseek_v3_tokens_half_as_often_as_the_all_to_all():
    """DeepSeek-V3 at ep 64 over 8 nodes: 3.2 remote nodes per token (node-limited) against
    8 x 7/8 = 7 copies leaving the node, so the network part is about 2.2x smaller."""
    cluster, model = load_cluster("dgx-h100", nodes=128), load_model("deepseek-v3")
    training, layout = TrainingSpec(global_batch=1024), Layout(tp=1, pp=16, dp=64, ep=64, zero=1)
    plain = estimate(cluster, model, training, layout, load_engine("megatron-core"))
    deepep = estimate(cluster, model, training, layout, load_engine("megatron-core").with_ep_dispatcher("deepep"))
    assert 1.9 < plain.time_s["ep_comm"] / deepep.time_s["ep_comm"] < 2.4


def test_vectorised_search_prices_the_dispatcher_as_the_scalar_estimate(mixtral_case):
    cluster, model, training = mixtral_case
    engine = load_engine("megatron-core").with_ep_dispatcher("deepep")
    result = search(cluster, model, training, Space(max_micro_batch=2, max_vpp=2), engine=engine)
    wide = (result.layouts["ep"] > 1) & (result.layouts["tp"] * result.layouts["ep"] > 8)  # ep across nodes
    rows = np.flatnonzero(wide)[:24]
    assert len(rows)
    sample = {k: a[rows] for k, a in result.layouts.items()}
    vec = evaluate(cluster, model, training, sample, result.orders, engine)
    one = evaluate_scalar(cluster, model, training, sample, result.orders, engine)
    np.testing.assert_allclose(np.asarray(vec["step_time_s"], float), np.asarray(one["step_time_s"], float), rtol=1e-9)
    plain = evaluate(cluster, model, training, sample, result.orders, load_engine("megatron-core"))
    assert (np.asarray(plain["step_time_s"]) > np.asarray(vec["step_time_s"])).all()


def test_engines_refuse_a_dispatcher_they_do_not_run_by_name():
    with pytest.raises(LayoutError, match="torchtitan cannot run --ep-dispatcher deepep; use one of alltoall"):
        load_engine("torchtitan").with_ep_dispatcher("deepep")
    with pytest.raises(LayoutError, match="has no --ep-dispatcher 'nccl'"):
        load_engine("megatron-core").with_ep_dispatcher("nccl")
    with pytest.raises(LayoutError, match="megatron-lm-2021 has no expert parallelism: drop --ep-dispatcher"):
        load_engine("megatron-lm-2021").with_ep_dispatcher("deepep")
    with pytest.raises(ValueError, match="runs_as.ep_dispatcher 'deepep' is not in can_run.ep_dispatchers"):
        EngineSpec(name="x", runs_as={"ep_dispatcher": "deepep"})


def test_megatron_flags_of_each_dispatcher():
    assert dispatcher_args("alltoall") == ["--moe-token-dispatcher-type", "alltoall"]
    assert dispatcher_args("deepep") == ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                                         "deepep"]


def test_emit_writes_the_dispatcher_the_plan_was_predicted_with(mixtral_case):
    from plan3d.emit.megatron import MegatronRun, emit_megatron
    run = MegatronRun(data_path="mock", tokenizer="null", train_iters=10, lr=3e-4)

    cluster, model, training = mixtral_case
    layout = Layout(tp=1, pp=1, dp=64, ep=8, zero=1)
    engine = load_engine("megatron-core").with_ep_dispatcher("hybridep")
    text = emit_megatron(build_plan(cluster, model, training, layout, engine=engine), run).text
    assert "--moe-token-dispatcher-type flex" in text and "--moe-flex-dispatcher-backend hybridep" in text
    plain = emit_megatron(build_plan(cluster, model, training, layout, engine=load_engine("megatron-core")),
                          run).text
    assert "--moe-token-dispatcher-type alltoall" in plain and "flex" not in plain


def test_cli_ep_dispatcher(capsys):
    args = ["-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", "8", "--engine", "megatron-core"]
    code, out, _ = run_cli(capsys, "estimate", *args, "--dp", "64", "--ep", "8", "--order", "tp-cp-dp-pp",
                           "--ep-dispatcher", "deepep")
    assert code == 0 and "ep 8 (deepep dispatcher)" in out
    code, out, _ = run_cli(capsys, "estimate", *args, "--dp", "64", "--ep", "8", "--ep-overlap", "combined-1f1b")
    flat = " ".join(out.split())  # rich wraps the header line
    assert code == 0 and "ep 8 (alltoall dispatcher, combined-1f1b overlap)" in flat
    code, out, err = run_cli(capsys, "estimate", *args, "--dp", "64", "--ep", "8", "--ep-dispatcher", "nccl")
    assert code != 0 and "has no --ep-dispatcher 'nccl'" in out + err and "Traceback" not in out + err


# ---- the all-to-all overlap (RunsAs.ep_overlap, --ep-overlap combined-1f1b) ----------------------
def combined_engine():
    return load_engine("megatron-core").with_ep_overlap("combined-1f1b")


def test_combined_1f1b_rules_as_megatron_states_them(mixtral_case):
    _, model, _ = mixtral_case
    engine = combined_engine()
    assert engine.layout_problems(Layout(tp=1, pp=2, vpp=2, dp=32, ep=8, zero=1), model) == []
    flat = engine.layout_problems(Layout(tp=1, pp=2, dp=32, ep=8, zero=1), model)
    assert len(flat) == 1 and "only on a virtual pipeline" in flat[0]
    full = engine.layout_problems(Layout(tp=1, pp=1, dp=64, ep=8, zero=1, recompute="full"), model)
    assert len(full) == 1 and "without full recompute" in full[0]
    assert engine.layout_problems(Layout(tp=1, pp=2, dp=32, zero=1, recompute="full"), model) == []  # ep = 1


def test_search_under_combined_1f1b_proposes_only_what_megatron_runs(mixtral_case):
    cluster, model, training = mixtral_case
    engine = combined_engine()
    result = search(cluster, model, training, Space(max_micro_batch=2, max_vpp=2), engine=engine)
    rows = np.flatnonzero(result.layouts["ep"] > 1)
    assert len(rows)
    for i in rows[:: max(1, len(rows) // 40)]:
        layout = layout_at(result.layouts, result.orders, int(i), model.layers)
        assert engine.layout_problems(layout, model) == [], layout.short()


def test_combined_1f1b_hides_the_all_to_alls_behind_the_other_micro_batch(mixtral_case):
    """exposed = max(a2a - computation, 0) per micro-batch, the computation on the SMs the
    all-to-alls leave (1 / (1 - f_b_comm_sm_share) slower): fully hidden where the all-to-alls
    are shorter (Mixtral, ep 8 over 8 nodes), the excess exposed where they are longer (256
    experts top-8 at ep 32 over 4 nodes: 3.0 s of all-to-alls against 1.9 s of computation)."""
    import yaml

    cluster, model, training = mixtral_case
    wide_model = ModelSpec(**yaml.safe_load(WIDE_MOE))
    cases = [(cluster, model, training, Layout(tp=8, pp=1, dp=8, ep=8, zero=1, sequence_parallel=True)),
             (load_cluster("dgx-h100", nodes=16), wide_model, TrainingSpec(global_batch=1024),
              Layout(tp=1, pp=1, dp=128, ep=32, zero=1))]
    engine = combined_engine()
    slow = 1 / (1 - engine.runs_as.f_b_comm_sm_share)
    exposed = []
    for cl, mo, tr, layout in cases:
        plain = estimate(cl, mo, tr, layout, load_engine("megatron-core"))
        hidden = estimate(cl, mo, tr, layout, engine)
        assert hidden.time_s["compute"] == pytest.approx(plain.time_s["compute"] * slow, rel=1e-9)
        busy = (plain.time_s["compute"] + plain.time_s["recompute"]) * slow
        assert hidden.time_s["ep_comm"] == pytest.approx(max(plain.time_s["ep_comm"] - busy, 0.0), abs=1e-9)
        exposed.append(hidden.time_s["ep_comm"])
    assert exposed[0] == 0.0 and exposed[1] > 0.3
    dense = Layout(tp=8, pp=1, dp=8, zero=1, sequence_parallel=True)  # ep = 1: nothing paired
    assert estimate(cluster, model, training, dense, engine).step_time_s == pytest.approx(
        estimate(cluster, model, training, dense, load_engine("megatron-core")).step_time_s)


def test_emit_writes_the_overlap_and_drops_the_shared_expert_overlap():
    from plan3d.emit.megatron import MegatronRun, emit_megatron
    run = MegatronRun(data_path="mock", tokenizer="null", train_iters=10, lr=3e-4)
    cluster, model = load_cluster("dgx-h100", nodes=128), load_model("deepseek-v3")
    layout = Layout(tp=1, pp=1, dp=1024, ep=64, zero=1)
    training = TrainingSpec(global_batch=1024)
    text = emit_megatron(build_plan(cluster, model, training, layout, engine=combined_engine()), run).text
    assert "--overlap-moe-expert-parallel-comm" in text and "--moe-shared-expert-overlap" not in text
    plain = emit_megatron(build_plan(cluster, model, training, layout, engine=load_engine("megatron-core")), run).text
    assert "--overlap-moe-expert-parallel-comm" not in plain and "--moe-shared-expert-overlap" in plain


WIDE_MOE = """name: wide-moe
layers: 16
hidden: 4096
heads: 32
kv_heads: 4
ffn_hidden: 8192
activation: swiglu
norm: rmsnorm
position: rope
bias: false
vocab: 32000
seq_len: 4096
moe: {experts: 256, top_k: 8, expert_ffn_hidden: 2048}
default_global_batch: 1024
"""


def test_recommend_names_what_a_hierarchical_dispatcher_would_give(tmp_path, capsys):
    """ep 32 over 4 nodes, 256 experts top-8: recommend (all-to-all) notes the fastest fitting
    layout under deepep, and that time is what recommend --ep-dispatcher deepep ranks."""
    import json

    spec = tmp_path / "wide-moe.yaml"
    spec.write_text(WIDE_MOE)
    args = ["recommend", "-c", "dgx-h100", "-m", spec, "--nodes", "16", "--engine", "megatron-core", "--ep", "32",
            "--json", "--top", "1"]
    code, out, _ = run_cli(capsys, *args)
    notes = [n for n in json.loads(out)["notes"] if n.startswith("with --ep-dispatcher deepep")]
    assert code == 0 and len(notes) == 1
    noted = float(notes[0].split(" at ")[1].split(" s,")[0])
    code, out, _ = run_cli(capsys, *args, "--ep-dispatcher", "deepep")
    data = json.loads(out)
    assert code == 0 and not any(n.startswith("with --ep-dispatcher") for n in data["notes"])
    assert data["top"][0]["step_time_s"] == pytest.approx(noted, abs=0.05)


def test_an_overlap_the_engine_cannot_run_is_refused_by_name(capsys):
    with pytest.raises(LayoutError, match="torchtitan cannot run --ep-overlap combined-1f1b; use one of none"):
        load_engine("torchtitan").with_ep_overlap("combined-1f1b")
    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "mixtral-8x7b", "--nodes", "8",
                             "--engine", "torchtitan", "--ep-overlap", "combined-1f1b")
    assert code != 0 and "cannot run --ep-overlap combined-1f1b" in out + err and "Traceback" not in out + err


JOB = ("cluster: dgx-h100\nnodes: 16\nmodel: wide-moe.yaml\nengine: megatron-core\n"
       "training: {global_batch: 1024}\nlayout: {tp: 1, dp: 128, ep: 32, zero: 1}\n")


def test_a_job_file_states_its_dispatcher_and_overlap(tmp_path, capsys):
    """A CI job file predicts what it runs: `ep_dispatcher` / `ep_overlap` change the step as the
    flags do; a value the engine lacks or a misspelled one is one line naming the field."""
    import json

    (tmp_path / "wide-moe.yaml").write_text(WIDE_MOE)
    plain, deepep, overlap, wrong, titan = (tmp_path / f"{n}.yaml" for n in ("plain", "deepep", "overlap", "wrong",
                                                                               "titan"))
    plain.write_text(JOB)
    deepep.write_text(JOB + "ep_dispatcher: deepep\n")
    overlap.write_text(JOB + "ep_overlap: combined-1f1b\n")
    wrong.write_text(JOB + "ep_dispatcher: deep\n")
    titan.write_text(JOB.replace("megatron-core", "torchtitan") + "ep_dispatcher: deepep\n")
    steps = []
    for job in (plain, deepep, overlap):
        code, out, _ = run_cli(capsys, "check", str(job), "--json")
        assert code == 0, out
        steps.append(json.loads(out)["estimate"]["step_time_s"])
    assert steps[1] < steps[0] and steps[2] < steps[0] and steps[1] != steps[2]
    code, out, err = run_cli(capsys, "check", str(wrong))
    assert code == 2 and "ep_dispatcher" in err and "deepep" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "check", str(titan))
    assert code == 2 and "torchtitan cannot run --ep-dispatcher deepep; use one of alltoall" in err


def test_an_ep_group_over_nodes_of_a_three_tier_network_counts_nodes_not_leaves():
    """With NVLink nodes of 8, 64-GPU leaf switches and a spine, an ep group of 128 consecutive
    ranks spans 16 nodes (2 leaves): the hierarchical dispatch crosses 15 other nodes, its
    NVLink part at the node's bandwidth (review finding: it counted leaves)."""
    base = load_cluster("dgx-h100", nodes=32)
    nvlink, ib = base.network[0], base.network[1]
    leaf = ib.model_copy(update={"name": "leaf", "domain_gpus": 64})
    cluster = base.model_copy(update={"network": [nvlink, leaf, ib]})
    link = layout_links(1, 1, 256, "tp-cp-ep-dp-pp", tuple(cluster.tiers()), 8, 1, 128)["ep"]
    assert link.domains == 16
    assert link.inner_bytes_per_s == pytest.approx(tuple(cluster.tiers())[0].cost("all_gather")[0])


@pytest.mark.parametrize("seq, work", [(128, 1.0), (4096, (32 + 1) / 64), (131072, (1024 + 1) / 2048), (64, 1.0)])
def test_causal_attention_work_is_the_lower_triangle_of_tiles(seq, work):
    from plan3d.cost.context import causal_attention_work
    assert causal_attention_work(seq) == pytest.approx(work)


def test_flash_engines_price_half_the_score_work_and_unfused_ones_all_of_it():
    from plan3d.cost.context import make_context
    model, training = load_model("llama3-8b"), TrainingSpec(global_batch=64)
    assert make_context(None, model, training, load_engine("megatron-core")).attention_work == pytest.approx(
        (model.seq_len / 128 + 1) / (2 * model.seq_len / 128))
    assert make_context(None, model, training, load_engine("megatron-lm-2021")).attention_work == 1.0
    assert make_context(None, model, training, None).attention_work == 1.0


def test_recommend_names_the_fastest_layout_at_each_expert_parallel_degree(capsys):
    """An MoE recommend says, per ep, the fastest fitting layout and the term that grows most
    against #1 (why EP64 recipes are not at the top), as the search's own rows give them."""
    import json
    import re

    code, out, _ = run_cli(capsys, "recommend", "-c", "dgx-a100-40g", "--nodes", "16", "-m", "mixtral-8x7b",
                           "--engine", "megatron-core", "--top", "1", "--json")
    assert code == 0, out
    data = json.loads(out)
    note = next(n for n in data["notes"] if n.startswith("fastest fitting layout per expert-parallel degree"))
    assert f"ep{data['top'][0]['layout']['ep']} {data['top'][0]['step_time_s']:.1f} s (#1)" in note
    per_ep = dict(re.findall(r"ep(\d+) ([\d.]+) s", note))
    assert len(per_ep) >= 3 and "8" in per_ep
    top_ep = str(data["top"][0]["layout"]["ep"])
    slower = [e for e, t in per_ep.items() if e != top_ep and float(t) > data["top"][0]["step_time_s"]]
    assert slower and all(re.search(rf"ep{e} [\d.]+ s, [a-z ]+ \+[\d.]+ s", note) for e in slower)
    code, out, _ = run_cli(capsys, "recommend", "-c", "dgx-h100", "--nodes", "2", "-m", "llama3-8b",
                           "--engine", "megatron-core", "--top", "1", "--json")
    assert not any("expert-parallel degree" in n for n in json.loads(out)["notes"])


def test_combined_1f1b_needs_a_16_bit_model_everywhere(capsys):
    """TransformerConfig: 'overlap_moe_expert_parallel_comm is only supported with bf16 or fp16
    model': estimate, recommend and check refuse fp32 with it, in one sentence."""
    from plan3d.errors import LayoutError
    from plan3d.search import search

    engine = load_engine("megatron-core").with_ep_overlap("combined-1f1b")
    assert engine.training_problems(TrainingSpec(global_batch=64, precision="fp32"))
    assert not engine.training_problems(TrainingSpec(global_batch=64, precision="fp8"))
    with pytest.raises(LayoutError, match="bf16 or fp16 model"):
        search(load_cluster("dgx-h100", 2), load_model("mixtral-8x7b"), TrainingSpec(global_batch=64, precision="fp32"),
               engine=engine)
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "--nodes", "2", "-m", "mixtral-8x7b",
                             "--engine", "megatron-core", "--precision", "fp32", "--tp", "2", "--pp", "2", "--vpp", "2",
                             "--dp", "4", "--ep", "4", "--ep-overlap", "combined-1f1b", "--global-batch", "64")
    assert code != 0 and "bf16 or fp16 model" in out + err and "Traceback" not in out + err


def test_job_problems_joins_the_layout_and_the_training_refusals():
    """EngineSpec.job_problems, the one call of estimate, check, emit and recommend: combined-1F1B
    refuses an fp32 model (training) and, with pp > 1, a layout without a virtual pipeline (layout)."""
    from plan3d.layout import Layout

    engine = load_engine("megatron-core").with_ep_overlap("combined-1f1b")
    model, fp32 = load_model("mixtral-8x7b"), TrainingSpec(global_batch=64, precision="fp32")
    good = Layout(tp=2, pp=2, vpp=2, dp=4, ep=4, zero=1, sequence_parallel=True)
    bad = good.model_copy(update={"vpp": 1})
    assert engine.job_problems(good, model, fp32) == engine.training_problems(fp32) != []
    both = engine.job_problems(bad, model, fp32)
    assert both == engine.layout_problems(bad, model) + engine.training_problems(fp32)
    assert len(both) > len(engine.training_problems(fp32))
    assert engine.job_problems(good, model, TrainingSpec(global_batch=64)) == []
