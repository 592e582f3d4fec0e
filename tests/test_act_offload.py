"""Activation offloading (`--act-offload`, Megatron-Core fine-grained activation offloading): the
bytes each choice moves by hand, what stays on the GPU, the exposed copy time, the engine's rules,
the emitted flags, the CLI and the recommend note."""
import json

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost import core, memory
from plan3d.cost.arrays import layout_arrays
from plan3d.cost.context import make_context
from plan3d.cost.estimate import estimate
from plan3d.emit.megatron import megatron_args, megatron_job
from plan3d.errors import LayoutError
from plan3d.layout import Layout
from plan3d.plan import build_plan
from plan3d.search import Space, engine_space, search
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.model import ModelSpec, MoESpec
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

def one(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])
TRAINING = TrainingSpec(global_batch=8, precision="bf16")
# h 64, 4 heads of 16, 2 KV heads, SwiGLU experts of 48, 8 experts top-2, seq 32
MOE = ModelSpec(name="offload-moe", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32,
                activation="swiglu", norm="rmsnorm", position="rope", bias=False,
                moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=48, every=1))


def engine(offload: str = "none"):
    return load_engine("megatron-core").with_act_offload(offload)


def arrays(recompute: str = "none", tp: int = 1, ep: int = 1):
    return layout_arrays(8, [tp], [1], [1], [1], [1], [1], [RECOMPUTE_CODES[recompute]], [int(tp > 1)], ep=[ep])


def test_experts_offload_moves_fc1_and_activation_inputs_by_hand():
    ctx = make_context(None, MOE, TRAINING, engine("experts"))
    la = arrays()
    routed = 2 * 32 * ctx.moe_load  # top_k x tokens x the load prior
    fc1_input = routed * 64 * 2  # the permuted tokens, h wide, bf16
    act_input = routed * 48 * 2 * 2  # SwiGLU's gate and up, bf16
    dense, moe = memory.offloaded_bytes(ctx, la)
    assert one(dense) == 0.0
    assert one(moe) == pytest.approx(fc1_input + act_input)


def test_all_offload_adds_the_attention_inputs_by_hand():
    ctx = make_context(None, MOE, TRAINING, engine("all"))
    la = arrays()
    q, kv, s, h = 64, 32, 32, 64
    attention = 2 * s * h * 2 + s * (2 * q + 2 * kv) * 2  # norm in/out + Q, K, V, output
    dense, moe = memory.offloaded_bytes(ctx, la)
    experts = memory.offloaded_bytes(make_context(None, MOE, TRAINING, engine("experts")), la)[1]
    assert one(dense) == pytest.approx(attention)
    assert one(moe) == pytest.approx(attention + one(experts))


def test_fp8_offloads_the_fp8_saved_inputs_at_one_byte():
    fp8 = TrainingSpec(global_batch=8, precision="fp8")
    la = arrays()
    bf16 = memory.offloaded_bytes(make_context(None, MOE, TRAINING, engine("all")), la)[1]
    low = memory.offloaded_bytes(make_context(None, MOE, fp8, engine("all")), la)[1]
    ctx = make_context(None, MOE, fp8, engine("all"))
    one_byte = 32 * 64 + 32 * 64 + 2 * 32 * ctx.moe_load * 64  # norm output, projection input, FC1 input
    assert one(bf16 - low) == pytest.approx(one_byte)


def test_offload_leaves_two_layers_on_the_gpu_and_the_rest_in_host_memory():
    la = arrays()
    base = make_context(None, MOE, TRAINING, engine())
    off = make_context(None, MOE, TRAINING, engine("experts"))
    moved = one(memory.offloaded_bytes(off, la)[1])
    keep = memory.stage_activation_bytes(base, la, np.zeros(1), np.full(1, 4.0), np.full(1, 4.0))
    less = memory.stage_activation_bytes(off, la, np.zeros(1), np.full(1, 4.0), np.full(1, 4.0))
    assert one(keep - less) == pytest.approx((4 - memory.OFFLOAD_RESIDENT_LAYERS) * moved)
    host = memory.host_offload_bytes(off, la, np.zeros(1), np.full(1, 4.0), np.full(1, 4.0))
    assert one(host) == pytest.approx((4 - memory.OFFLOAD_RESIDENT_LAYERS) * moved)


def test_full_recompute_offloads_nothing():
    la = arrays("full")
    off = make_context(None, MOE, TRAINING, engine("all"))
    base = make_context(None, MOE, TRAINING, engine())
    args = (la, np.zeros(1), np.full(1, 4.0), np.full(1, 4.0))
    assert one(memory.stage_activation_bytes(off, *args)) == one(memory.stage_activation_bytes(base, *args))
    assert one(memory.host_offload_bytes(off, *args)) == 0.0


def test_exposed_copy_time_is_what_outlasts_forward_and_backward():
    cluster = load_cluster("gb200-nvl72")
    ctx = make_context(cluster, MOE, TRAINING, engine("experts"))
    la = arrays()
    moved = one(memory.offloaded_bytes(ctx, la)[1])
    copy = moved / (cluster.gpu.host_link_gbytes_per_s * 1e9)
    fwd = np.array([copy / 4])  # a layer much shorter than its copy
    exposed = core.offload_exposed_s(ctx, la, fwd, fwd)[1]
    assert one(exposed) == pytest.approx((copy - copy / 4) + (copy - copy / 2))
    hidden = core.offload_exposed_s(ctx, la, np.array([copy]), np.array([copy]))[1]
    assert one(hidden) == 0.0


def test_offload_lowers_the_peak_and_shows_its_time_and_host_memory():
    cluster, model = load_cluster("gb200-nvl72"), load_model("mixtral-8x7b")
    training = TrainingSpec(global_batch=256)
    layout = Layout(tp=1, pp=4, dp=8, ep=8, micro_batch=2, zero=1, recompute="none")
    plain = estimate(cluster, model, training, layout, engine())
    off = estimate(cluster, model, training, layout, engine("experts"))
    assert off.memory_bytes["activations"] < plain.memory_bytes["activations"]
    assert off.host_offload_bytes > 0 and plain.host_offload_bytes == 0
    assert off.time_s["offload"] >= 0 and plain.time_s["offload"] == 0
    assert off.act_offload == "experts" and off.region["extrapolated"]


def test_engine_rules_refuse_moe_recompute_and_dense_models():
    assert engine("experts").offload_problems("moe")
    assert not engine("experts").offload_problems("moe-act")
    assert engine("experts").layout_problems(Layout(recompute="moe", ep=1), MOE)
    assert engine("experts").model_problems(load_model("llama3-8b"))
    assert not engine("all").model_problems(load_model("llama3-8b"))
    with pytest.raises(LayoutError, match="cannot run --act-offload experts"):
        load_engine("torchtitan").with_act_offload("experts")
    space = engine_space(Space(), engine("experts"))
    assert "moe" not in space.recompute and "moe-act" in space.recompute
    with pytest.raises(LayoutError, match="whole MoE block"):
        engine_space(Space(recompute=("moe",)), engine("experts"))


def test_search_never_proposes_moe_recompute_under_expert_offload():
    cluster = load_cluster("dgx-h100").model_copy(update={"nodes": 1})
    result = search(cluster, load_model("tiny-moe"), TrainingSpec(global_batch=8),
                    Space(max_pp=1), engine=engine("experts"))
    assert result.size and RECOMPUTE_CODES["moe"] not in set(result.layouts["recompute"].tolist())


def test_megatron_job_writes_the_modules_and_the_environment():
    cluster, model = load_cluster("gb200-nvl72"), load_model("mixtral-8x7b")
    layout = Layout(tp=1, pp=4, dp=8, ep=8, micro_batch=2, zero=1)
    plan = build_plan(cluster, model, TrainingSpec(global_batch=256), layout, None, engine("experts"))
    args = megatron_args(plan)
    i = args.index("--offload-modules")
    assert "--fine-grained-activation-offloading" in args and args[i + 1:i + 3] == ["expert_fc1", "moe_act"]
    job, _ = megatron_job(plan)
    assert any("NVTE_CPU_OFFLOAD_V1=1" in line for line in job.environment)
    plain = build_plan(cluster, model, TrainingSpec(global_batch=256), layout, None, engine())
    assert "--fine-grained-activation-offloading" not in megatron_args(plain)


def test_cli_estimate_takes_act_offload(capsys):
    common = ["-c", "gb200-nvl72", "-m", "mixtral-8x7b", "--engine", "megatron-core", "--global-batch", "256"]
    code, out, _ = run_cli(capsys, "estimate", *common, "--tp", "1", "--pp", "4", "--dp", "8", "--ep", "8",
                           "--micro-batch", "2", "--act-offload", "experts", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["act_offload"] == "experts" and data["host_offload_bytes"] > 0
    code, out, _ = run_cli(capsys, "estimate", *common, "--tp", "1", "--pp", "4", "--dp", "8", "--ep", "8",
                           "--micro-batch", "2", "--act-offload", "experts")
    text = " ".join(out.split())
    assert code == 0 and "host memory:" in text and "(expert_fc1 moe_act)" in text
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-8b", "--engine", "torchtitan",
                             "--act-offload", "experts")
    assert code != 0 and "act-offload" in out + err and "Traceback" not in out + err


def test_recommend_names_a_faster_offloaded_layout(capsys):
    args = ["recommend", "-c", "gb200-nvl72", "--nodes", "2", "-m", "mixtral-8x7b", "--engine", "megatron-core",
            "--global-batch", "128", "--micro-batch", "16", "--recompute", "none", "--top", "1", "--json"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0, out
    plain = json.loads(out)
    note = next(n for n in plain["notes"] if "--act-offload experts" in n)
    code, out, _ = run_cli(capsys, *args, "--act-offload", "experts")
    offloaded = json.loads(out)
    assert code == 0 and not any("--act-offload" in n for n in offloaded["notes"])
    assert offloaded["top"][0]["step_time_s"] < plain["top"][0]["step_time_s"]
    assert offloaded["top"][0]["offload_s"] >= 0 and "less than the fastest layout without" in note


JOB = """cluster: gb200-nvl72
nodes: 2
model: mixtral-8x7b
training: {global_batch: 256, precision: bf16}
layout: {tp: 1, pp: 4, dp: 2, ep: 2, micro_batch: 2, zero: 1}
engine: megatron-core
"""


def test_a_job_file_states_its_offload(tmp_path, capsys):
    """`act_offload:` in a CI job file is --act-offload: less GPU memory, the offload shown; a value
    the engine lacks is one line naming it."""
    plain, offload, titan = (tmp_path / f"{n}.yaml" for n in ("plain", "offload", "titan"))
    plain.write_text(JOB)
    offload.write_text(JOB + "act_offload: experts\n")
    titan.write_text(JOB.replace("megatron-core", "torchtitan") + "act_offload: experts\n")
    peaks = []
    for job in (plain, offload):
        code, out, _ = run_cli(capsys, "check", str(job), "--json")
        assert code == 0, out
        est = json.loads(out)["estimate"]
        peaks.append((est["peak_memory_bytes"], est["act_offload"], est["host_offload_bytes"]))
    assert peaks[1][0] < peaks[0][0] and peaks[1][1] == "experts" and peaks[1][2] > 0
    assert peaks[0][1] == "none" and peaks[0][2] == 0
    code, out, err = run_cli(capsys, "check", str(titan))
    assert code == 2 and "torchtitan cannot run --act-offload experts; use one of none" in err


def test_every_band_axis_has_a_recommend_table_label():
    from plan3d.cost.bands import AXES, SCALE
    from plan3d.render.recommend import AXIS_LABELS
    assert {a.name for a in AXES + (SCALE,)} <= set(AXIS_LABELS)


def test_recommend_table_with_offload_prints(capsys):
    code, out, err = run_cli(capsys, "recommend", "-c", "gb200-nvl72", "--nodes", "2", "-m", "mixtral-8x7b",
                             "--engine", "megatron-core", "--global-batch", "128", "--micro-batch", "16",
                             "--recompute", "none", "--act-offload", "experts", "--top", "2")
    assert code == 0, out + err
    assert "offload" in out and "Traceback" not in out + err


def test_offloading_moves_only_what_the_recompute_keeps():
    """mla-up already drops the per-head Q, K, V (and the layernorm module MLA's input-norm output):
    `all` offloading moves what is left, so the two savings do not add up."""
    cluster, model = load_cluster("dgx-h100", 16), load_model("deepseek-v3")
    training = TrainingSpec(global_batch=1024)
    layout = Layout(tp=1, pp=16, dp=8, ep=8, micro_batch=1, zero=1, recompute="mla-up",
                    pp_layers=(3,) + (4,) * 14 + (2,))
    none = Layout(**{**layout.model_dump(), "recompute": "none"})
    act = {(r.recompute, o): estimate(cluster, model, training, r, engine(o)).memory_bytes["activations"]
           for r in (none, layout) for o in ("none", "all")}
    saved_by_recompute = act[("none", "none")] - act[("mla-up", "none")]
    saved_by_offload = act[("none", "none")] - act[("none", "all")]
    saved_by_both = act[("none", "none")] - act[("mla-up", "all")]
    assert 0 < saved_by_both < saved_by_recompute + saved_by_offload
    ctx = make_context(None, model, training, engine("all"))
    la = layout_arrays(1024, [1], [16], [8], [1], [1], [1], [RECOMPUTE_CODES["mla-up"]], [0], ep=[8])
    plain = layout_arrays(1024, [1], [16], [8], [1], [1], [1], [RECOMPUTE_CODES["none"]], [0], ep=[8])
    dropped = one(memory.mla_up_discarded_elements(ctx, la) + memory.input_norm_discarded_elements(ctx, la)) * 2
    assert one(memory.offloaded_bytes(ctx, plain)[0] - memory.offloaded_bytes(ctx, la)[0]) == pytest.approx(dropped)


def test_a_dense_model_offloads_the_attention_modules_only():
    cluster, model = load_cluster("dgx-h100", 2), load_model("llama3-8b")
    plan = build_plan(cluster, model, TrainingSpec(global_batch=64), Layout(tp=2, dp=8, zero=1, sequence_parallel=True),
                      None, engine("all"))
    args = megatron_args(plan)
    at = args.index("--offload-modules")
    assert args[at + 1:at + 4] == ["qkv_linear", "core_attn", "attn_proj"] and "expert_fc1" not in args


def test_a_list_valued_flag_keeps_its_values_on_its_line():
    from plan3d.emit.launch_script import _array_lines
    lines = _array_lines(["--recompute-modules", "moe_act", "layernorm", "--bf16", "--tp", "2"])
    assert lines == ["  --recompute-modules moe_act layernorm", "  --bf16", "  --tp 2"]


def test_reevaluating_a_search_with_offload_matches_the_offloaded_search():
    """`search.reevaluate` (what recommend's offload note predicts) gives each layout the metrics and
    fit the offloaded engine's own search gives it, and leaves out the recompute it refuses (moe)."""
    from plan3d.search import reevaluate

    cluster = load_cluster("gb200-nvl72").with_size(nodes=2)
    model, training = load_model("mixtral-8x7b"), TrainingSpec(global_batch=128)
    engine = load_engine("megatron-core")
    space = Space(max_micro_batch=4)
    plain = search(cluster, model, training, space, engine=engine)
    offload = engine.with_act_offload("experts")
    full = search(cluster, model, training, space, engine=offload)
    index, metrics, codes = reevaluate(plain, offload, np.ones(plain.size, dtype=bool))
    assert len(index) == full.size > 0
    assert not (plain.layouts["recompute"][index] == RECOMPUTE_CODES["moe"]).any()
    mine = {plain.layout(int(i)).short(): (t, c) for i, t, c in zip(index, metrics["step_time_s"], codes)}
    theirs = {full.layout(i).short(): (full.metrics["step_time_s"][i], full.codes[i]) for i in range(full.size)}
    assert mine.keys() == theirs.keys()
    for key, (t, c) in mine.items():
        assert t == pytest.approx(theirs[key][0], rel=1e-12) and c == theirs[key][1], key


def test_the_offload_note_counts_a_memory_fraction_refusal_as_memory(capsys):
    """A layout refused by --max-memory-fraction (not by the GPU) fits once offloading frees memory:
    the note names it (the full offloaded search finds it too: tp1 pp1 dp8 ep2 zero3 moe-act)."""
    code, out, _ = run_cli(capsys, "recommend", "-c", "gb200-nvl72", "--nodes", "2", "-m", "mixtral-8x7b",
                           "--engine", "megatron-core", "--global-batch", "128", "--max-micro-batch", "4",
                           "--max-memory-fraction", "0.6", "--json")
    assert code == 0, out
    note = next(n for n in json.loads(out)["notes"] if "--act-offload experts" in n)
    assert "less than the fastest layout without" in note and "zero3" in note
