"""Context parallelism's K/V exchange as each engine runs it (`--cp-comm`, RunsAs.cp_comm):
p2p ring (Megatron-Core's default), all_gather (Megatron --cp-comm-type all_gather; torchtitan
0.3's flex_cp_allgather and plan3d's runtime, which save the gathered K/V) and a2a (Ulysses)."""
from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost import comm
from plan3d.cost.arrays import layout_arrays
from plan3d.cost.context import make_context
from plan3d.cost.core import Links, cp_exposed_s
from plan3d.cost.estimate import estimate
from plan3d.cost.memory import cp_kv_chunk_bytes, cp_ring_buffer_bytes
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.torchtitan import emit_torchtitan
from plan3d.errors import InfeasibleError, LayoutError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.search import CP_HEADS_CODE, Space, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.engine import EngineSpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

LONG = 131072
BW, LATENCY = 5e10, 1e-5  # one link for every collective kind in the hand calculations


@pytest.fixture(scope="module")
def h100():
    return load_cluster("dgx-h100", 16)


@pytest.fixture(scope="module")
def llama70():
    return load_model("llama3-70b")


def _arrays(cp: int, tp: int = 8, recompute: str = "none"):
    return layout_arrays(64, [tp], [1], [1], [1], [1], [0], [RECOMPUTE_CODES[recompute]], [1.0], [cp])


def _links():
    one = (np.array([BW]), np.array([LATENCY]))
    return Links({("cp", op): one for op in ("p2p", "all_gather", "reduce_scatter")})


def _context(cluster, model, engine: EngineSpec, seq: int = LONG):
    return make_context(cluster, model, TrainingSpec(global_batch=64, seq_len=seq), engine)


# ---- time: each exchange by hand -------------------------------------------------------------------
def test_all_gather_is_blocking_and_transformer_engine_gathers_again_in_the_backward(h100, llama70):
    ctx = _context(h100, llama70, load_engine("megatron-core").with_cp_comm("all_gather"))
    la = _arrays(cp=8)
    gathered = 8 * cp_kv_chunk_bytes(ctx, la)[0]
    one = comm.all_gather_s(gathered, 8, BW, LATENCY)
    fwd, bwd = cp_exposed_s(ctx, la, _links(), np.array([10.0]))  # a long attention hides none of it
    assert fwd[0] == pytest.approx(one)
    assert bwd[0] == pytest.approx(2 * one)  # gather K/V again, reduce-scatter dK/dV (same volume)


def test_saved_gathered_kv_skips_the_second_gather(h100, llama70):
    ctx = _context(h100, llama70, load_engine("torchtitan"))
    assert (ctx.cp_comm, ctx.cp_kv_saved) == ("all_gather", True)
    la = _arrays(cp=8)
    one = comm.all_gather_s(8 * cp_kv_chunk_bytes(ctx, la)[0], 8, BW, LATENCY)
    fwd, bwd = cp_exposed_s(ctx, la, _links(), np.array([10.0]))
    assert (fwd[0], bwd[0]) == pytest.approx((one, one))


def test_a2a_moves_q_k_v_and_the_output_both_ways(h100, llama70):
    ctx = _context(h100, llama70, load_engine("megatron-core").with_cp_comm("a2a"))
    la = _arrays(cp=4)
    tokens = LONG / 4
    qkvo = tokens * (2 * ctx.q_dim + 2 * ctx.kv_dim) / 8 * 2  # bf16, tp 8
    fwd, bwd = cp_exposed_s(ctx, la, _links(), np.array([10.0]))
    assert fwd[0] == bwd[0] == pytest.approx(comm.all_gather_s(qkvo, 4, BW, LATENCY))


def test_only_the_ring_hides_behind_attention(h100, llama70):
    """A long attention hides the whole p2p ring; all_gather and a2a stay exposed."""
    la, links, long_attention = _arrays(cp=8), _links(), np.array([10.0])
    exposed = {}
    for mode in ("p2p", "all_gather", "a2a"):
        ctx = _context(h100, llama70, load_engine("megatron-core").with_cp_comm(mode))
        exposed[mode] = sum(part[0] for part in cp_exposed_s(ctx, la, links, long_attention))
    assert exposed["p2p"] == 0.0
    assert exposed["all_gather"] > 0 and exposed["a2a"] > 0


# ---- memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, mode, chunks", [("megatron-core", "p2p", 4), ("megatron-core", "all_gather", 16),
                                                  ("torchtitan", "all_gather", 8)])
def test_buffers_hold_the_exchange(h100, llama70, engine, mode, chunks):
    """TE's all_gather holds the gathered K/V and dK/dV; torchtitan's saved K/V are activations,
    only the gathered dK/dV are a buffer."""
    ctx = _context(h100, llama70, load_engine(engine).with_cp_comm(mode))
    la = _arrays(cp=8)
    assert cp_ring_buffer_bytes(ctx, la)[0] == pytest.approx(chunks * cp_kv_chunk_bytes(ctx, la)[0])


def test_saved_gathered_kv_adds_the_other_ranks_chunks_to_every_layer(h100, llama70):
    """torchtitan's autograd keeps the gathered K/V of every layer for the backward: cp - 1 chunks
    more per layer and micro-batch in flight than an engine that re-gathers."""
    training = TrainingSpec(global_batch=64, seq_len=LONG)
    layout = Layout(tp=8, pp=1, dp=2, cp=8, zero=3, sequence_parallel=True)
    titan = load_engine("torchtitan")
    regather = titan.model_copy(update={"runs_as": titan.runs_as.model_copy(update={"cp_gathered_kv_saved": False})})
    saved = estimate(h100, llama70, training, layout, titan).memory_bytes["activations"]
    plain = estimate(h100, llama70, training, layout, regather).memory_bytes["activations"]
    ctx = _context(h100, llama70, titan)
    chunk = cp_kv_chunk_bytes(ctx, _arrays(cp=8))[0]
    assert saved - plain == pytest.approx(80 * 7 * chunk)  # 80 layers, one micro-batch in flight (pp 1)


def test_moe_layers_save_the_gathered_kv_too(h100):
    mixtral = load_model("mixtral-8x7b")
    training = TrainingSpec(global_batch=64, seq_len=32768)
    layout = Layout(tp=1, pp=1, dp=32, cp=4, ep=8, zero=3)
    titan = load_engine("torchtitan")
    regather = titan.model_copy(update={"runs_as": titan.runs_as.model_copy(update={"cp_gathered_kv_saved": False})})
    saved = estimate(h100, mixtral, training, layout, titan).memory_bytes["activations"]
    plain = estimate(h100, mixtral, training, layout, regather).memory_bytes["activations"]
    chunk = cp_kv_chunk_bytes(_context(h100, mixtral, titan, seq=32768), _arrays(cp=4, tp=1))[0]
    assert saved - plain == pytest.approx(32 * 3 * chunk)  # 32 MoE layers, cp - 1 = 3 chunks each


def test_the_runtimes_ring_keeps_its_blocks_like_all_gather(h100, llama70):
    training = TrainingSpec(global_batch=64, seq_len=LONG)
    layout = Layout(tp=8, pp=1, dp=2, cp=8, zero=3, sequence_parallel=True)
    runtime = load_engine("plan3d-runtime")
    ring = estimate(h100, llama70, training, layout, runtime.with_cp_comm("p2p")).memory_bytes["activations"]
    gathered = estimate(h100, llama70, training, layout, runtime).memory_bytes["activations"]
    megatron = estimate(h100, llama70, training, layout, load_engine("megatron-core")).memory_bytes["activations"]
    assert ring == pytest.approx(gathered) and ring > megatron


# ---- the engines' choices, and bad choices -------------------------------------------------------
def test_engines_run_what_their_code_runs():
    assert load_engine("megatron-core").runs_as.cp_comm == "p2p"
    assert load_engine("torchtitan").can_run.cp_comm == ["all_gather"]
    assert load_engine("plan3d-runtime").runs_as.cp_comm == "all_gather"


@pytest.mark.parametrize("engine, mode, match", [
    ("torchtitan", "p2p", r"torchtitan cannot run --cp-comm p2p; use one of all_gather"),
    ("megatron-core", "ring", r"megatron-core has no --cp-comm 'ring'; use one of p2p, all_gather, a2a"),
    ("deepspeed-0.19", "p2p", r"deepspeed-0.19 has no context parallelism: drop --cp-comm"),
])
def test_a_choice_the_engine_cannot_run_is_one_line(engine, mode, match):
    with pytest.raises(LayoutError, match=match):
        load_engine(engine).with_cp_comm(mode)


def test_a_profile_running_what_it_cannot_is_refused():
    data = load_engine("torchtitan").model_dump()
    data["runs_as"]["cp_comm"] = "p2p"
    with pytest.raises(ValueError, match="runs_as.cp_comm 'p2p' is not in can_run.cp_comm .* add it there or set"):
        EngineSpec(**data)


def test_a2a_needs_heads_per_tp_rank_divisible_by_cp(llama70):
    engine = load_engine("megatron-core").with_cp_comm("a2a")
    assert engine.layout_problems(Layout(tp=4, dp=2, cp=2, sequence_parallel=True), llama70) == []
    problems = engine.layout_problems(Layout(tp=8, dp=1, cp=2, sequence_parallel=True), llama70)
    assert problems == ["--cp-comm a2a splits heads over cp: 8 heads and 1 KV heads per tp rank do not divide "
                        "by cp=2; use --cp-comm p2p or tp in {1, 2, 4} for cp=2"]
    tp2 = engine.layout_problems(Layout(tp=2, dp=1, cp=8, sequence_parallel=True), llama70)
    assert tp2 == ["--cp-comm a2a splits heads over cp: 32 heads and 4 KV heads per tp rank do not divide by "
                   "cp=8; use --cp-comm p2p or cp in {2, 4} at tp=2 or tp in {1} for cp=8"]


def test_the_search_keeps_only_layouts_a2a_can_split(h100, llama70):
    training = TrainingSpec(global_batch=64, seq_len=32768)
    engine = load_engine("megatron-core").with_cp_comm("a2a")
    result = search(h100, llama70, training, Space(min_cp=2, max_cp=8), engine=engine)
    assert result.rejected[CP_HEADS_CODE] > 0
    cp, tp = result.layouts["cp"], result.layouts["tp"]
    assert len(cp) and np.all(((64 // tp) % cp == 0) & ((8 // tp) % cp == 0))
    for i in range(len(cp)):  # every kept layout passes the scalar rule of estimate
        assert engine.cp_comm_problems(result.layout(i), llama70) == []
    ring = search(h100, llama70, training, Space(min_cp=2, max_cp=8), engine=load_engine("megatron-core"))
    dropped = [ring.layout(i) for i in range(len(ring.layouts["cp"]))
               if not (((64 // ring.layouts["tp"][i]) % ring.layouts["cp"][i] == 0)
                       and ((8 // ring.layouts["tp"][i]) % ring.layouts["cp"][i] == 0))]
    assert dropped and all(engine.cp_comm_problems(layout, llama70) for layout in dropped)
    assert ring.rejected.get(CP_HEADS_CODE, 0) == 0
    assert len(ring.layouts["cp"]) > len(cp)


# ---- the command line ----------------------------------------------------------------------------
ESTIMATE = ("estimate", "-c", "dgx-h100", "-m", "llama3-70b", "--nodes", "16", "--tp", "8", "--cp", "8",
            "--dp", "2", "--seq-len", "131072", "--global-batch", "16", "--sequence-parallel", "--zero", "1",
            "--recompute", "full", "--json")


def test_estimate_prices_the_exchange_it_is_given(capsys):
    import json

    times = {}
    for mode in ("p2p", "all_gather"):
        code, out, _ = run_cli(capsys, *ESTIMATE, "--cp-comm", mode)
        assert code == 0
        times[mode] = json.loads(out)["time_s"]["tp_comm"]
    assert times["all_gather"] > times["p2p"]  # cp 8 crosses nodes: the blocking gather shows


def test_estimate_refuses_a2a_it_cannot_split(capsys):
    code, out, err = run_cli(capsys, *ESTIMATE, "--cp-comm", "a2a")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: --cp-comm a2a splits heads over cp: 8 heads and 1 KV heads per tp "
                                        "rank do not divide by cp=8; use --cp-comm p2p or tp in {1} for cp=8"]


def test_job_file_names_the_exchange(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: dgx-h100\nnodes: 16\nmodel: llama3-70b\nengine: torchtitan\ncp_comm: p2p\n"
                   "training: {global_batch: 16, seq_len: 131072}\n"
                   "layout: {tp: 8, cp: 8, dp: 2, zero: 3, sequence_parallel: true, recompute: full}\n")
    code, _, err = run_cli(capsys, "check", str(job))
    assert code == 2
    assert "torchtitan cannot run --cp-comm p2p; use one of all_gather" in err


# ---- emitters -------------------------------------------------------------------------------------
def _plan(engine: EngineSpec | None, cp: int = 2, zero: int = 1):
    cluster = load_cluster("dgx-h100", 1)
    training = TrainingSpec(global_batch=16, seq_len=16384)
    layout = Layout(tp=4, dp=8 // (4 * cp), cp=cp, zero=zero, sequence_parallel=True)
    return build_plan(cluster, load_model("llama3-70b"), training, layout, engine=engine)


@pytest.mark.parametrize("mode", ["p2p", "all_gather", "a2a"])
def test_megatron_writes_the_planned_exchange(mode):
    text = emit_megatron(_plan(load_engine("megatron-core").with_cp_comm(mode))).text
    assert f"--cp-comm-type {mode}" in text


def test_megatron_writes_no_exchange_without_cp():
    assert "--cp-comm-type" not in emit_megatron(_plan(load_engine("megatron-core"), cp=1)).text


def test_torchtitan_refuses_a_plan_made_for_an_exchange_it_does_not_run():
    titan = load_engine("torchtitan")
    widened = titan.model_copy(update={
        "can_run": titan.can_run.model_copy(update={"cp_comm": ["all_gather", "p2p"]}),
        "runs_as": titan.runs_as.model_copy(update={"cp_comm": "p2p"})})
    with pytest.raises(InfeasibleError, match="torchtitan cannot run --cp-comm p2p"):
        emit_torchtitan(_plan(widened, zero=3))
    assert "context_parallel_degree" in emit_torchtitan(_plan(titan, zero=3)).text


def test_the_runtimes_synchronous_ring_hides_nothing(h100, llama70):
    """plan3d's runtime shifts K/V synchronously (cp_ring_overlap false): all cp - 1 transfers
    show however long the attention, where Megatron-Core's ring hides them; its ring keeps the
    blocks it received, so the backward sends dK/dV only (one chunk, not K/V and dK/dV)."""
    runtime = load_engine("plan3d-runtime").with_cp_comm("p2p")
    ctx = _context(h100, llama70, runtime)
    la = _arrays(cp=8)
    send = comm.p2p_s(cp_kv_chunk_bytes(ctx, la)[0], BW, LATENCY)
    fwd, bwd = cp_exposed_s(ctx, la, _links(), np.array([10.0]))
    assert fwd[0] == pytest.approx(7 * send)
    assert bwd[0] == pytest.approx(7 * send)


def test_launch_refuses_an_exchange_the_runtime_does_not_run():
    from plan3d.run.launch import runtime_problems

    cluster = load_cluster("local-cpu")
    model = load_model("tiny-gpt")
    layout = Layout(cp=2, dp=cluster.world_size // 2)
    training = TrainingSpec(global_batch=8, precision="fp32")
    a2a = build_plan(cluster, model, training, layout, engine=load_engine("megatron-core").with_cp_comm("a2a"))
    assert runtime_problems(a2a) == ["the bundled runtime exchanges K/V by all_gather or p2p, not a2a; "
                                     "re-plan with --cp-comm all_gather"]
    ring = build_plan(cluster, model, training, layout, engine=load_engine("megatron-core"))
    assert ring.cp_comm == "p2p" and runtime_problems(ring) == []
    assert build_plan(cluster, model, training, layout).cp_comm == "all_gather"


# ---- plans: saved, loaded, emitted, launched ------------------------------------------------------
@pytest.mark.parametrize("engine, want", [("torchtitan", "all_gather"), ("plan3d-runtime", "all_gather"),
                                          ("megatron-core", "p2p")])
def test_a_plan_saved_before_engines_stated_the_exchange_keeps_what_its_engine_ran(tmp_path, engine, want):
    """Older plans' engines have no cp_comm fields; their defaults (p2p, overlapped, not saved)
    must not replace what the bundled profile of that engine runs."""
    import json

    from plan3d.plan import CP_RUN_FIELDS, Plan, content_digest, load_plan, save_plan

    plan = _plan(load_engine(engine), zero=3 if engine == "torchtitan" else 1)
    path = tmp_path / "old.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    for key in CP_RUN_FIELDS:
        del data["engine"]["runs_as"][key]
    del data["engine"]["can_run"]["cp_comm"]
    data["digest"] = content_digest(data)
    path.write_text(json.dumps(data))
    loaded = load_plan(str(path))
    assert loaded.cp_comm == want
    assert loaded.engine.runs_as == load_engine(engine).runs_as
    rewritten = tmp_path / "rewritten.json"  # launch re-writes the plan into its run directory,
    save_plan(loaded, rewritten)  # and every worker reads it back without a second digest check
    assert Plan.model_validate_json(rewritten.read_text()).cp_comm == want


def test_recommend_out_carries_the_exchange_to_emit_and_launch(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-8b", "--nodes", "2", "--seq-len",
                           "32768", "--global-batch", "16", "--cp", "4", "--cp-comm", "all_gather", "--out", str(plan))
    assert code == 0, err
    code, out, err = run_cli(capsys, "emit", "megatron", str(plan))
    assert code == 0, err
    assert "--cp-comm-type all_gather" in out
    code, _, err = run_cli(capsys, "launch", str(plan), "--cp-comm", "p2p", "--dry-run")
    assert code == 2
    assert err.strip().splitlines() == [f"error: --cp-comm applies to a layout given by flags; {plan} runs the "
                                        "exchange it was planned with: re-plan with --cp-comm p2p"]


def test_emitting_for_another_engine_keeps_an_exchange_it_runs():
    gathered = _plan(load_engine("torchtitan"), zero=3)
    # Llama-3 8B: the 70B on one node would not fit under Megatron-Core's memory model (emit refuses that)
    assert "--cp-comm-type all_gather" in emit_megatron(gathered.model_copy(
        update={"layout": gathered.layout.model_copy(update={"zero": 1}), "model": load_model("llama3-8b")})).text


def test_launch_predicts_the_exchange_the_runtime_will_run():
    from plan3d.run.compare import predicted_for_run

    cluster, model = load_cluster("local-cpu"), load_model("tiny-gpt")
    training = TrainingSpec(global_batch=8, precision="bf16")
    layout = Layout(cp=2, dp=cluster.world_size // 2)
    ring = build_plan(cluster, model, training, layout, engine=load_engine("megatron-core"))
    gathered = build_plan(cluster, model, training, layout, engine=load_engine("torchtitan"))
    assert predicted_for_run(ring, "fp32").cp_comm == "p2p"
    assert predicted_for_run(gathered, "fp32").cp_comm == "all_gather"


def test_estimate_says_which_exchange_it_priced(capsys):
    code, out, _ = run_cli(capsys, *[a for a in ESTIMATE if a != "--json"], "--cp-comm", "all_gather")
    assert code == 0 and "cp 8 (all_gather K/V exchange)" in out.replace("\n", " ")
