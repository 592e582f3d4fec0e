"""Context parallelism in the planner: the layout rule, the search, the memory and time model, the CLI.

The formulas (docs/cost-model.md, "Context parallelism") follow Megatron-Core's CP: 2 * cp
load-balanced chunks per sequence, K/V circulated on a ring (Transformer Engine
AttnFuncWithCPAndKVP2P), gradients reduced over dp x cp."""
from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import run_cli
from plan3d.cost.arrays import layout_arrays
from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.cost.comm import layout_links
from plan3d.cost.context import make_context
from plan3d.cost.core import Links, cp_ring_exposed_s
from plan3d.cost.memory import cp_kv_chunk_bytes
from plan3d.cost.estimate import estimate
from plan3d.errors import LayoutError
from plan3d.layout import Layout, layout_problems
from plan3d.search import CP_AUTO_MIN_TOKENS, Space, engine_space, search, shape_grid, shape_reasons
from plan3d.specs.catalog import load_cluster, load_engine, load_model
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES

LONG = 131072


@pytest.fixture(scope="module")
def h100_2048():
    return load_cluster("dgx-h100", 256)


@pytest.fixture(scope="module")
def llama405():
    return load_model("llama3-405b")


# ---- the hand calculation of docs/cost-model.md ------------------------------------------------
def hand_memory(model, seq: int, tp: int, cp: int, dp: int) -> dict[str, float]:
    """Memory of one rank of the docs' example (pp 1, micro-batch 1, ZeRO-3, sequence parallel,
    bf16 with fp32 gradients and Adam), written out from the model's numbers alone."""
    h, f, layers, vocab = model.hidden, model.ffn_hidden_, model.layers, model.vocab
    q, kv = model.heads * (h // model.heads), model.kv_heads_ * (h // model.heads)
    split = h * (q + 2 * kv) + q * h + 3 * h * f  # SwiGLU, no biases
    per_layer = split / tp + 2 * h  # two RMSNorm weight vectors replicated
    vocab_rows = -(-vocab // tp) * h  # padded to a multiple of tp, split over tp
    params = layers * per_layer + vocab_rows + h + vocab_rows  # embedding; final norm + untied head
    shards = dp * cp  # ZeRO-3 over the dp x cp group
    tokens = seq // cp  # the rank's share of the sequence
    # bf16 bytes: norm and QKV/MLP inputs 4 * 2 bytes per h (Llama trains without dropout: no masks)
    layer_acts = 8 * tokens * h / tp + 2 * tokens * (2 * q + 2 * kv) / tp + 2 * tokens * f * 3 / tp
    logits = tokens * vocab / tp * 6  # Megatron's loss: the bf16 logits and the fp32 copy it saves
    kv_chunk = 2 * tokens * kv / tp * 2  # K and V of the rank's tokens, bf16
    buffers = tokens * h * 2 + 2 * per_layer * 2 + 4 * kv_chunk  # SP gather, two ZeRO-3 layers, ring
    return {"weights": params * 2 / shards, "gradients": params * 4 / shards, "optimizer": params * 12 / shards,
            "activations": layers * layer_acts + logits, "buffers": buffers}


def test_the_documented_cp16_example_adds_up_by_hand(h100_2048, llama405):
    """`plan3d estimate -c dgx-h100 -m llama3-405b --nodes 256 --seq-len 131072 --global-batch 128
    --tp 8 --cp 16 --zero 3 --sequence-parallel`: every memory row recomputed from the model."""
    training = TrainingSpec(global_batch=128, seq_len=LONG)
    layout = Layout(tp=8, cp=16, dp=16, zero=3, sequence_parallel=True)
    est = estimate(h100_2048, llama405, training, layout, load_engine("megatron-core"))
    hand = hand_memory(llama405, LONG, tp=8, cp=16, dp=16)
    for key, value in hand.items():
        assert est.memory_bytes[key] == pytest.approx(value, rel=1e-12), key
    total = sum(hand.values()) + est.memory_bytes["reserve"]
    assert est.peak_memory_bytes == pytest.approx(total, rel=1e-12)
    assert est.fits and est.peak_memory_bytes / 2**30 == pytest.approx(70.3, abs=0.05)  # the docs' figure
    assert est.tiers["cp"] == "ib-ndr" and est.tiers["dp_cp"] == "ib-ndr"  # tp 8 fills the node first


# ---- memory ----------------------------------------------------------------------------------
def test_activations_are_those_of_the_rank_share_of_the_sequence(h100_2048, llama405):
    """cp = 4 at seq 32768 stores per rank what cp = 1 stores at seq 8192; the ring adds buffers."""
    short = estimate(h100_2048, llama405, TrainingSpec(global_batch=64, seq_len=8192),
                     Layout(tp=8, pp=9, dp=4, cp=1, sequence_parallel=True, recompute="full"))
    long = estimate(h100_2048, llama405, TrainingSpec(global_batch=64, seq_len=32768),
                    Layout(tp=8, pp=9, dp=4, cp=4, sequence_parallel=True, recompute="full"))
    assert long.memory_bytes["activations"] == short.memory_bytes["activations"]
    ring = 4 * 2 * 8192 * (llama405.kv_heads_ * 128) / 8 * 2
    assert long.memory_bytes["buffers"] - short.memory_bytes["buffers"] == pytest.approx(ring)


def test_zero_shards_over_dp_times_cp(h100_2048, llama405):
    training = TrainingSpec(global_batch=64, seq_len=32768)
    one = estimate(h100_2048, llama405, training, Layout(tp=8, pp=2, dp=16, cp=2, zero=1, sequence_parallel=True))
    two = estimate(h100_2048, llama405, training, Layout(tp=8, pp=2, dp=8, cp=4, zero=1, sequence_parallel=True))
    plain = estimate(h100_2048, llama405, training, Layout(tp=8, pp=2, dp=16, cp=1, zero=1, sequence_parallel=True))
    assert one.memory_bytes["optimizer"] == two.memory_bytes["optimizer"]  # dp * cp = 32 both
    assert plain.memory_bytes["optimizer"] == pytest.approx(2 * one.memory_bytes["optimizer"])  # over 16 only
    assert one.memory_bytes["weights"] == plain.memory_bytes["weights"]  # ZeRO-1 leaves weights whole


# ---- time ------------------------------------------------------------------------------------
def test_ring_exposure_is_what_attention_cannot_hide(h100_2048, llama405):
    training = TrainingSpec(global_batch=64, seq_len=LONG)
    ctx = make_context(h100_2048, llama405, training, load_engine("megatron-core"))
    la = layout_arrays(64, [8], [1], [16], [1], [1], [0], [RECOMPUTE_CODES["none"]], [1.0], [16])
    attention = np.array([2e-3])
    slow, fast = (1e9, 1e-5), (4e11, 1e-6)
    for bw, latency in (slow, fast):
        links = Links({("cp", "p2p"): (np.array([bw]), np.array([latency]))})
        fwd, bwd = cp_ring_exposed_s(ctx, la, links, attention)
        send = cp_kv_chunk_bytes(ctx, la) / bw + latency
        step = attention / 16
        assert fwd == pytest.approx(15 * max(send[0] - step[0], 0.0))
        assert bwd == pytest.approx(15 * max(2 * cp_kv_chunk_bytes(ctx, la)[0] / bw + latency - 2 * step[0], 0.0))
    links = Links({("cp", "p2p"): (np.array([slow[0]]), np.array([slow[1]]))})
    assert cp_ring_exposed_s(ctx, la, links, attention)[0][0] > 0  # 1 GB/s cannot hide 4 MiB behind 0.1 ms
    links = Links({("cp", "p2p"): (np.array([fast[0]]), np.array([fast[1]]))})
    assert cp_ring_exposed_s(ctx, la, links, np.array([1.0]))[0][0] == 0  # a long attention hides it all


def test_compute_per_micro_batch_falls_with_cp(h100_2048, llama405):
    """On the same GPUs, cp 2 halves each micro-batch's tokens per rank and doubles the
    micro-batches per pipeline (dp halves): the step's compute stays, each micro-batch's halves."""
    training = TrainingSpec(global_batch=64, seq_len=LONG)
    engine = load_engine("megatron-core")
    base = dict(tp=8, pp=2, recompute="full", sequence_parallel=True)
    alone = estimate(h100_2048, llama405, training, Layout(dp=32, cp=1, **base), engine)
    cp2 = estimate(h100_2048, llama405, training, Layout(dp=16, cp=2, **base), engine)
    per_micro_batch = (cp2.time_s["compute"] / 4) / (alone.time_s["compute"] / 2)
    assert 0.5 <= per_micro_batch < 0.51  # half the FLOPs; smaller GEMMs run a little less efficiently
    assert cp2.time_s["compute"] == pytest.approx(alone.time_s["compute"], rel=0.02)
    # at 128K each ring step's attention (tens of ms) hides its K/V send over InfiniBand (about 1 ms):
    # TP traffic per micro-batch halves, micro-batches double, and the ring adds nothing exposed
    assert cp2.time_s["tp_comm"] == pytest.approx(alone.time_s["tp_comm"], rel=0.01)


# ---- the rule ----------------------------------------------------------------------------------
def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused(llama405):
    training = TrainingSpec(global_batch=64, seq_len=8192 + 8)  # divisible by 8, not by 2*8
    problems = layout_problems(Layout(tp=1, pp=1, dp=8, cp=8), llama405, training, 64)
    assert len(problems) == 1 and "2*cp = 16" in problems[0] and "valid cp" in problems[0]
    assert not layout_problems(Layout(dp=8, cp=4), llama405, training, 32)  # 8200 = 8 * 1025
    sp = layout_problems(Layout(tp=8, dp=2, cp=2, sequence_parallel=True), llama405,
                         TrainingSpec(global_batch=64, seq_len=8 * 2 * 2 * 3 + 8), 32)
    assert sp and "tp*2*cp=32" in sp[0]


def test_search_codes_match_the_sentences_with_cp(llama405):
    training = TrainingSpec(global_batch=48, seq_len=96)  # divisible by 2*cp for cp 1, 2, 3, 4, 6, 8 only
    grid = shape_grid(96, Space(max_cp=0, max_micro_batch=2, max_vpp=1, max_pp=2), seq_len=96)
    assert {1, 2, 3, 32}.issubset(set(grid["cp"].tolist()))
    codes = shape_reasons(grid, llama405, training)
    for i in range(len(codes)):
        layout = Layout(**{k: grid[k][i].item() for k in ("tp", "pp", "dp", "cp", "micro_batch", "vpp",
                                                          "sequence_parallel")})
        assert (codes[i] == 0) == (not layout_problems(layout, llama405, training, 96)), layout.short()
    assert ((grid["cp"] == 32) & (codes == 0)).sum() == 0  # 96 is not divisible by 64


# ---- the search ------------------------------------------------------------------------------------
def test_default_bound_keeps_short_sequences_at_cp1_and_searches_cp_for_long_ones(h100_2048, llama405):
    assert Space().cp_bound(8192) == 1 and Space().cp_bound(LONG) == LONG // CP_AUTO_MIN_TOKENS == 16
    engine = load_engine("megatron-core")
    short = search(h100_2048, llama405, TrainingSpec(global_batch=2048, seq_len=8192), engine=engine)
    assert set(short.layouts["cp"].tolist()) == {1}
    long = search(h100_2048, llama405, TrainingSpec(global_batch=128, seq_len=LONG), engine=engine)
    assert set(long.layouts["cp"].tolist()) <= {1, 2, 4, 8, 16} and (long.layouts["cp"] > 1).any()
    best = long.layout(int(np.argmax(np.where(long.feasible, long.metrics["tokens_per_s"], -1))))
    assert best.cp > 1  # at 128K no cp = 1 layout fits: activations of 131,072 tokens per rank
    assert not (long.feasible & (long.layouts["cp"] == 1)).any()
    assert long.find(best) is not None


def test_vectorised_cp_estimates_equal_the_scalar_ones(h100_2048, llama405):
    training = TrainingSpec(global_batch=128, seq_len=LONG)
    engine = load_engine("megatron-core")
    layouts = [Layout(tp=8, dp=16, cp=16, zero=3, sequence_parallel=True),
               Layout(tp=2, pp=2, dp=32, cp=16, zero=1, recompute="full", sequence_parallel=True),
               Layout(tp=4, pp=9, dp=4, cp=4, recompute="selective", sequence_parallel=True, micro_batch=2)]
    col = lambda f: np.array([f(x) for x in layouts])  # noqa: E731
    cands = Candidates(col(lambda x: x.tp), col(lambda x: x.pp), col(lambda x: x.dp), col(lambda x: x.micro_batch),
                       col(lambda x: x.vpp), col(lambda x: x.zero), col(lambda x: RECOMPUTE_CODES[x.recompute]),
                       col(lambda x: x.sequence_parallel), np.zeros(3, dtype=int), cp=col(lambda x: x.cp))
    batch = estimate_batch(h100_2048, llama405, training, cands, ("tp-cp-ep-dp-pp",), engine)
    for i, layout in enumerate(layouts):
        one = estimate(h100_2048, llama405, training, layout, engine)
        assert batch["step_time_s"][i] == pytest.approx(one.step_time_s, rel=1e-9)
        assert batch["peak_memory_bytes"][i] == pytest.approx(one.peak_memory_bytes, rel=1e-9)
        assert batch["tp_comm_s"][i] == pytest.approx(one.time_s["tp_comm"], rel=1e-9)


def test_cp_link_is_the_cp_group_tier(h100_2048):
    tiers = tuple(h100_2048.tiers())
    inside = layout_links(2, 1, 16, "tp-cp-ep-dp-pp", tiers, 8, 4)  # tp 2 x cp 4 fill one node
    across = layout_links(8, 1, 16, "tp-cp-ep-dp-pp", tiers, 8, 4)  # tp 8 fills it: cp crosses nodes
    assert inside["cp"].tier == "nvlink4" and across["cp"].tier == "ib-ndr"
    assert inside["dp_cp"].tier == "ib-ndr"


def test_an_engine_without_cp_searches_cp1_and_refuses_a_fixed_cp():
    deepspeed = load_engine("deepspeed-0.19")
    assert engine_space(Space(), deepspeed).max_cp == 1
    with pytest.raises(LayoutError, match="no context parallelism"):
        engine_space(Space(min_cp=2, max_cp=2), deepspeed)


# ---- the command line ----------------------------------------------------------------------------
def test_estimate_cp_flag(capsys):
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "256",
                             "--seq-len", LONG, "--global-batch", 128, "--tp", 8, "--cp", 16, "--zero", 3,
                             "--sequence-parallel")
    assert code == 0, err
    assert "cp 16" in out and "cp ib-ndr" in out and "not modelled" not in out + err
    code, out, err = run_cli(capsys, "estimate", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "256",
                             "--seq-len", 8200, "--cp", 8, "--global-batch", 256)
    assert code != 0 and "2*cp = 16" in err and "Traceback" not in err


def test_recommend_cp_flags(capsys):
    args = ("recommend", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "256", "--seq-len", LONG,
            "--global-batch", 128, "--top", 3)
    code, out, err = run_cli(capsys, *args, "--cp", 8)
    assert code == 0, err
    assert "┃ cp ┃" in out and "cp8" in out and "cp16" not in out
    code, out, err = run_cli(capsys, *args, "--max-cp", 0)
    assert code != 0 and "--max-cp must be >= 1" in err
    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", "llama3-405b", "--nodes", "256",
                             "--engine", "deepspeed-0.19", "--cp", 2)
    assert code != 0 and "no context parallelism" in err
