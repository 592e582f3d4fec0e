"""Megatron-Core arguments that define the model (plan3d/emit/megatron_model.py, megatron_moe.py):
each spec field that changes what pretrain_gpt.py builds reaches its flag, and a value no flag
expresses is refused before planning, by the profile's `can_run.models`.

The engines tier (tests/engines/test_model_fidelity_engines.py) feeds the same blocks to
Megatron's own parser and TransformerConfig."""
from __future__ import annotations

import pytest

from cli_helpers import run_cli
from emit_helpers import make_plan, parse_megatron
from plan3d.emit.megatron import emit_megatron
from plan3d.emit.megatron_model import padded_vocab, vocab_alignment
from plan3d.errors import InfeasibleError
from plan3d.specs.catalog import load_engine, load_model
from plan3d.specs.model import RopeScaling


def deepseek(**update):
    """DeepSeek-V3's shapes at 8 layers, so a plan on 4 nodes stays small; `update` changes fields."""
    model = load_model("deepseek-v3")
    return model.model_copy(update={"name": "dsv3-8l", "layers": 8, **update})


def megatron_args(model, **layout) -> dict:
    return parse_megatron(emit_megatron(make_plan(model, **layout)).text)


def test_deepseek_v3_norms_yarn_and_routing_reach_their_flags():
    args = megatron_args(deepseek(), pp=2, dp=16, ep=8, zero=1)
    assert args["--norm-epsilon"] == "1e-06" and args["--qk-layernorm"] is True
    assert (args["--rope-type"], args["--rotary-scaling-factor"]) == ("yarn", "40.0")
    assert (args["--mscale"], args["--mscale-all-dim"]) == ("1.0", "1.0")
    assert "--no-rope-fusion" not in args  # MLA's fused RoPE runs with YaRN
    assert args["--moe-router-topk-scaling-factor"] == "2.5"
    assert (args["--moe-router-num-groups"], args["--moe-router-group-topk"]) == ("8", "4")
    assert "--moe-router-pre-softmax" not in args  # sigmoid: renormalised by Megatron itself


def test_mla_with_plain_rope_turns_the_rope_fusion_off():
    """MLATransformerConfig raises 'apply_rope_fusion for MLA only works with YARN RoPE' otherwise."""
    args = megatron_args(deepseek(rope_scaling=None), pp=2, dp=16, ep=8, zero=1)
    assert args["--rope-type"] == "rope" and args["--no-rope-fusion"] is True
    assert "--rotary-scaling-factor" not in args


def test_llama31_rope_scaling_and_a_dense_model_without_qk_norm():
    model = load_model("llama3-405b")
    args = megatron_args(model.model_copy(update={"layers": 8}), tp=8, pp=2, dp=2, zero=1, sequence_parallel=True)
    assert args["--use-rope-scaling"] is True and args["--rope-scaling-factor"] == "8.0"
    assert args["--position-embedding-type"] == "rope" and "--rope-type" not in args
    assert args["--norm-epsilon"] == "1e-05" and "--qk-layernorm" not in args
    unscaled = megatron_args(load_model("llama3-8b"), tp=2, dp=16, zero=1, sequence_parallel=True)
    assert "--use-rope-scaling" not in unscaled


def test_dense_yarn_is_megatrons_yarn_position_embedding():
    model = load_model("llama3-8b").model_copy(update={"rope_scaling": RopeScaling(type="yarn", factor=4)})
    args = megatron_args(model, dp=32, zero=1)
    assert args["--position-embedding-type"] == "yarn" and args["--rotary-scaling-factor"] == "4.0"


@pytest.mark.parametrize("vocab, tp, alignment, padded", [
    (128256, 8, 32, 128256),  # Llama 3: 32 x 8 divides it, 64 x 8 does not
    (128256, 1, 128, 128256),
    (50257, 8, 1, 50264),  # GPT-3 / GPT-2's odd vocabulary: padded to a multiple of tp, as plan3d's memory
    (32000, 4, 64, 32000),  # Mixtral: 128 x 4 does not divide it
])
def test_vocabulary_keeps_the_models_size_where_tp_divides_it(vocab, tp, alignment, padded):
    assert vocab_alignment(vocab, tp) == alignment and padded_vocab(vocab, tp) == padded


def test_emitted_vocabulary_alignment_and_padding_note():
    plan = make_plan("gpt3-175b", tp=8, pp=4, dp=1, zero=0, sequence_parallel=True, recompute="full")
    emitted = emit_megatron(plan)
    assert parse_megatron(emitted.text)["--make-vocab-size-divisible-by"] == "1"
    assert any("pads it to 50264 rows" in note for note in emitted.notes)
    llama = emit_megatron(make_plan(tp=8, dp=4, zero=1, sequence_parallel=True))
    assert parse_megatron(llama.text)["--make-vocab-size-divisible-by"] == "32"
    assert not any("pads it" in note for note in llama.notes)


def test_unnormalised_softmax_routing_is_pre_softmax():
    """Qwen2-MoE / DeepSeek-V2 (norm_topk_prob false): the softmax over all experts, then the top-k."""
    mixtral = load_model("mixtral-8x7b")
    model = mixtral.model_copy(update={"layers": 4, "moe": mixtral.moe.model_copy(update={"normalize_top_k": False})})
    args = megatron_args(model, tp=2, dp=16, ep=2, zero=1, sequence_parallel=True)
    assert args["--moe-router-pre-softmax"] is True
    assert "--moe-router-pre-softmax" not in megatron_args(mixtral.model_copy(update={"layers": 4}), tp=2, dp=16,
                                                           ep=2, zero=1, sequence_parallel=True)


@pytest.mark.parametrize("update, words", [
    (lambda m: {"moe": m.moe.model_copy(update={"normalize_top_k": False})},
     "unnormalised top-k weights of a sigmoid router"),
    (lambda m: {"rope_scaling": RopeScaling(type="yarn", factor=40, beta_fast=16)},
     "yarn rope scaling with beta_fast 16 (it fixes 32)"),
])
def test_megatron_core_refuses_what_no_flag_expresses(update, words):
    model = deepseek()
    problems = load_engine("megatron-core").model_problems(model.model_copy(update=update(model)))
    assert len(problems) == 1 and words in problems[0]


def test_recommend_refuses_a_llama3_scaling_megatron_hardcodes_otherwise(tmp_path, capsys):
    spec = load_model("llama3-8b").model_copy(update={
        "rope_scaling": RopeScaling(type="llama3", factor=8, low_freq_factor=2)})
    path = tmp_path / "llama-lf2.yaml"
    path.write_text(spec.model_dump_json(exclude_none=True))
    code, out, err = run_cli(capsys, "recommend", "-c", "dgx-h100", "-m", str(path), "--nodes", "1",
                             "--engine", "megatron-core")
    assert code != 0 and "low_freq_factor 2 (it fixes 1)" in err and "Traceback" not in err
    with pytest.raises(InfeasibleError, match="low_freq_factor 2"):
        emit_megatron(make_plan(spec, tp=2, dp=16, zero=1, sequence_parallel=True))
