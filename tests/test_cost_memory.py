"""Memory formulas: hand-computed model states, ZeRO terms, activations, monotonicity."""
import pytest

from plan3d.cost.arrays import layout_arrays
from plan3d.cost.context import make_context
from plan3d.cost.memory import layer_activation_bytes, model_state_bytes
from plan3d.specs.catalog import load_engine
from plan3d.cost.params import total_params
from plan3d.layout import Layout
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

SMALL = ModelSpec(name="small", layers=4, hidden=8, heads=2, vocab=10, seq_len=4)
MIXED = TrainingSpec(global_batch=8, precision="bf16", fp32_grad_accum=False)


def total_state_bytes(states: dict) -> float:
    return sum(states.values())


def test_single_rank_holds_16_bytes_per_param_without_fp32_grads():
    states = model_state_bytes(SMALL, MIXED, Layout(), 0)
    n = total_params(SMALL)
    assert states == {"weights": 2 * n, "gradients": 2 * n, "optimizer": 12 * n}


def test_fp32_gradient_accumulation_gives_18_bytes_and_fp32_gives_16():
    n = total_params(SMALL)
    accum = model_state_bytes(SMALL, MIXED.model_copy(update={"fp32_grad_accum": True}), Layout(), 0)
    assert total_state_bytes(accum) == 18 * n
    fp32 = model_state_bytes(SMALL, MIXED.model_copy(update={"precision": "fp32"}), Layout(), 0)
    assert fp32 == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    sgd = model_state_bytes(SMALL, MIXED.model_copy(update={"optimizer": "sgd"}), Layout(), 0)
    assert sgd["optimizer"] == 4 * n


def test_tensor_parallel_split_by_hand():
    # h=8, heads=2, ffn=32, vocab 10, seq 4, GELU, biases, LayerNorm, learned positions.
    h, f, v, s, t = 8, 32, 10, 4, 2
    split = (4 * h * h + 2 * h * f) + (3 * h + f)  # weights + column-parallel biases
    replicated = 2 * (2 * h) + 2 * h  # two LayerNorms + attention/MLP output biases
    per_layer = split / t + replicated
    expected = 4 * per_layer + v * h / t + s * h + (2 * h) + v * h / t  # embed, positions, final norm, head
    states = model_state_bytes(SMALL, MIXED, Layout(tp=t), 0)
    assert states["weights"] == pytest.approx(2 * expected, rel=1e-12)


def test_vocab_padded_only_when_tp_does_not_divide_it():
    odd = SMALL.model_copy(update={"vocab": 11})
    w1 = model_state_bytes(odd, MIXED, Layout(tp=2), 0)["weights"]
    w2 = model_state_bytes(odd.model_copy(update={"vocab": 12}), MIXED, Layout(tp=2), 0)["weights"]
    assert w1 == w2


def test_pipeline_stages_hold_layers_embedding_and_head():
    tied = SMALL.model_copy(update={"tied_embeddings": True})
    one = model_state_bytes(tied, MIXED, Layout(), 0)["weights"] / 2
    assert one == total_params(tied)
    stages = [model_state_bytes(tied, MIXED, Layout(pp=2), r)["weights"] / 2 for r in range(2)]
    assert sum(stages) == total_params(tied) + tied.vocab * tied.hidden  # last stage's own copy
    assert stages[0] != stages[1]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_shards_exactly_its_terms(zero):
    base = model_state_bytes(SMALL, MIXED, Layout(dp=4), 0)
    sharded = model_state_bytes(SMALL, MIXED, Layout(dp=4, zero=zero), 0)
    shards = {"optimizer": zero >= 1, "gradients": zero >= 2, "weights": zero >= 3}
    for key, is_sharded in shards.items():
        assert sharded[key] == pytest.approx(base[key] / 4 if is_sharded else base[key])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_larger_dp_never_raises_model_states_under_zero(zero):
    totals = [total_state_bytes(model_state_bytes(SMALL, MIXED, Layout(dp=d, zero=zero), 0)) for d in (1, 2, 4, 8)]
    assert all(b <= a for a, b in zip(totals, totals[1:]))


def classic_activation(tp, sp, dropout=0.1, engine=None):
    """Korthikanti et al. 2022, Table 2 (GPT with dropout 0.1), with flash attention (no 5as/h
    term) unless the engine runs unfused attention."""
    model = ModelSpec(name="gpt", layers=2, hidden=64, heads=4, vocab=100, seq_len=32, dropout=dropout)
    ctx = make_context(None, model, TrainingSpec(global_batch=8), engine)
    la = layout_arrays(8, [tp], [1], [1], [2], [1], [0], [0], [sp])
    return float(layer_activation_bytes(ctx, la)[0]), 32 * 2 * 64


def test_activations_reduce_to_korthikanti_table():
    got, sbh = classic_activation(1, 0)
    assert got == pytest.approx(34 * sbh)
    got, sbh = classic_activation(4, 0)
    assert got == pytest.approx(sbh * (10 + 24 / 4))
    got, sbh = classic_activation(4, 1)
    assert got == pytest.approx(34 * sbh / 4)


def test_dropout_masks_only_with_dropout():
    """Two 1-byte hidden-dropout masks per h element: 34 s*b*h with dropout, 32 without (Llama)."""
    got, sbh = classic_activation(1, 0, dropout=0.0)
    assert got == pytest.approx(32 * sbh)
    got, sbh = classic_activation(4, 0, dropout=0.0)
    assert got == pytest.approx(sbh * (8 + 24 / 4))


def test_unfused_attention_stores_the_scores_as_korthikanti_counts():
    """Unfused attention keeps softmax output, mask and dropout output: 5*a*s/h per s*b*h (Table 2),
    2*a*s/h without dropout; flash attention none. a=4, s=32, h=64: 5as/h = 10, 2as/h = 4."""
    unfused = load_engine("megatron-lm-2021")
    got, sbh = classic_activation(1, 0, engine=unfused)
    assert got == pytest.approx(sbh * (34 + 5 * 4 * 32 / 64))
    got, sbh = classic_activation(4, 0, engine=unfused)
    assert got == pytest.approx(sbh * (10 + 24 / 4 + 5 * 4 * 32 / (64 * 4)))
    got, sbh = classic_activation(1, 0, dropout=0.0, engine=unfused)
    assert got == pytest.approx(sbh * (32 + 2 * 4 * 32 / 64))
    flash, _ = classic_activation(1, 0, engine=load_engine("megatron-core"))
    assert flash == pytest.approx(34 * sbh)


def test_selective_recompute_drops_the_unfused_scores_only():
    """Selective recompute (Korthikanti Sec. 4.2) keeps the layer but the attention core: with
    unfused attention its stored activations fall by 5as/h * sbh, with flash by nothing."""
    from plan3d.cost.memory import stage_activation_bytes

    model = ModelSpec(name="gpt", layers=2, hidden=64, heads=4, vocab=100, seq_len=32, dropout=0.1)

    def stage(engine, recompute):
        ctx = make_context(None, model, TrainingSpec(global_batch=8), engine)
        la = layout_arrays(8, [1], [2], [1], [2], [1], [0], [recompute], [0])
        return float(stage_activation_bytes(ctx, la, 1.0, 1.0)[0])  # the last stage, one micro-batch in flight

    sbh = 32 * 2 * 64
    unfused, flash = load_engine("megatron-lm-2021"), load_engine("megatron-core")
    assert stage(unfused, 0) - stage(unfused, 1) == pytest.approx(5 * 4 * 32 / 64 * sbh)
    assert stage(flash, 0) == pytest.approx(stage(flash, 1))


def test_swiglu_stores_three_mlp_tensors():
    gelu = ModelSpec(name="a", layers=2, hidden=64, heads=4, vocab=100, seq_len=32, ffn_hidden=128)
    swiglu = gelu.model_copy(update={"activation": "swiglu"})
    la = layout_arrays(8, [1], [1], [1], [1], [1], [0], [0], [0])
    training = TrainingSpec(global_batch=8)
    diff = layer_activation_bytes(make_context(None, swiglu, training), la) - \
        layer_activation_bytes(make_context(None, gelu, training), la)
    assert float(diff[0]) == pytest.approx(2 * 32 * 128)  # one more s*B*ffn tensor in 16-bit


def test_in_flight_micro_batches_1f1b_and_interleaved():
    from dataclasses import replace

    from plan3d.cost.memory import in_flight
    from plan3d.specs.catalog import load_model

    ctx = make_context(None, load_model("tiny-gpt"), TrainingSpec(global_batch=64))
    la = layout_arrays(64, [1], [4], [1], [1], [1], [0], [0], [0])
    assert [float(in_flight(ctx, la, r)[0]) for r in range(4)] == [4, 3, 2, 1]
    inter = layout_arrays(64, [1], [4], [1], [1], [2], [0], [0], [0])
    assert float(in_flight(ctx, inter, 0)[0]) == pytest.approx(4 * (1 + 3 / (4 * 2)))  # Korthikanti
    few = layout_arrays(2, [1], [4], [1], [1], [1], [0], [0], [0])
    assert float(in_flight(ctx, few, 0)[0]) == 2  # never more than m
    # Megatron-Core's combined-1f1b overlap warms up one more chunk (with ep > 1 only)
    combined = replace(ctx, ep_combined_1f1b=True)
    expert = layout_arrays(64, [1], [4], [2], [1], [2], [0], [0], [0], ep=[2])
    assert float(in_flight(combined, expert, 0)[0]) == pytest.approx(4 * (1 + 3 / (4 * 2)) + 1 / 2)
    assert float(in_flight(combined, inter, 0)[0]) == pytest.approx(4 * (1 + 3 / (4 * 2)))


@pytest.mark.parametrize("bias, qkv_bias", [(False, True), (True, False), (True, None), (False, None)])
def test_memory_model_counts_the_biases_params_counts(bias, qkv_bias):
    """Q/K/V biases alone (Qwen2) or with the others: the per-rank weights sum to the model's count."""
    from plan3d.specs.model import ModelSpec

    spec = ModelSpec(name="qkv", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=32, bias=bias,
                     qkv_bias=qkv_bias, position="rope", norm="rmsnorm", activation="swiglu")
    one = model_state_bytes(spec, MIXED, Layout(), 0)["weights"] / 2
    assert one == total_params(spec)
    tp2 = model_state_bytes(spec, MIXED, Layout(tp=2), 0)["weights"] / 2
    assert tp2 < one
