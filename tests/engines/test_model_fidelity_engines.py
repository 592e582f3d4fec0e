"""The model Megatron would build from `plan3d emit megatron` is the model of the config.json.

For published configs (Llama-3.1-70B, Qwen2.5-7B, Mixtral-8x7B, DeepSeek-V3) the path a user
takes: `import-hf` -> a plan -> `emit megatron` -> Megatron-Core 0.19.2's own `parse_args`,
`validate_args` and `core_transformer_config_from_args`. Every field of the resulting
TransformerConfig that changes the model is compared with the config.json itself (not with
plan3d's spec): norm epsilon, dropout, q/k norms, RoPE base and scaling, GQA, biases, tied
output, the vocabulary Megatron pads to, the router; and Megatron's own parameter count
(theoretical_memory_usage.py) with the published total. GPT-3 175B (no config.json) is checked
against its bundled spec, with its dropout 0.1.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest

from conftest import require
from test_hf_import import LLAMA31_8B, QWEN25_7B
from test_hf_import_moe import DEEPSEEK_V3, MIXTRAL_8X7B
from test_megatron_engine import RUN, shell_parts, validated
from plan3d.emit.megatron import emit_megatron, gpu_arch
from plan3d.layout import Layout
from plan3d.plan import Plan, build_plan
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.hf import import_hf
from plan3d.specs.training import TrainingSpec

LLAMA31_70B = LLAMA31_8B | {  # meta-llama/Llama-3.1-70B: the 8B's keys, these shapes
    "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80}

# config, layout (world size as torchrun starts it), published total parameters in billions
CASES = {
    "llama3.1-70b": (LLAMA31_70B, dict(tp=8, pp=4, dp=2, zero=1, sequence_parallel=True), 70.55),
    "qwen2.5-7b": (QWEN25_7B, dict(tp=4, dp=8, zero=1, sequence_parallel=True), 7.62),
    "mixtral-8x7b": (MIXTRAL_8X7B, dict(tp=2, dp=8, ep=8, zero=1, sequence_parallel=True), 46.70),
    "deepseek-v3": (DEEPSEEK_V3, dict(pp=16, dp=8, ep=8, zero=1, pp_layers=(3,) + (4,) * 14 + (2,)), 671.03),
}


@pytest.fixture(scope="module")
def megatron():
    return require("megatron.training.arguments")


def imported_plan(tmp_path, config: dict, layout: dict) -> Plan:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = import_hf(str(path), seq_len=4096)
    layout = Layout(**layout)
    nodes = max(1, layout.world_size // 8)
    return build_plan(load_cluster("dgx-h100", nodes=nodes), model, TrainingSpec(global_batch=256), layout)


def megatron_config(megatron, plan: Plan):
    """(validated args, the TransformerConfig Megatron builds from them, its parameter count printout)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    try:
        from megatron.training.argument_utils import core_transformer_config_from_args
    except ImportError:  # 0.17
        from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    env, _, argv = shell_parts(emit_megatron(plan, RUN).text)
    args = validated(megatron, argv, plan.layout.world_size, gpu_arch(plan), env)
    fused_rope = args.apply_rope_fusion
    args.apply_rope_fusion = False  # the fused kernel needs Transformer Engine, absent on CPU
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    with contextlib.redirect_stdout(io.StringIO()):
        config = core_transformer_config_from_args(args, config_class)
    if args.multi_latent_attention:  # what MLATransformerConfig.__post_init__ raises with the fusion on
        assert not fused_rope or config.rope_type == "yarn", "apply_rope_fusion for MLA only works with YARN RoPE"
    args.padded_vocab_size = padded_vocab(args)  # what building the tokenizer sets
    printout = io.StringIO()
    with contextlib.redirect_stdout(printout):
        compute_weight_and_optimizer_memory(args, verbose=True)
    return args, config, printout.getvalue()


def total_parameters_b(printout: str) -> float:
    return float(re.search(r"Total number of parameters in billions: ([0-9.]+)", printout).group(1))


def padded_vocab(args) -> int:
    """The vocabulary Megatron builds (megatron/training/vocab_utils.py, its own padding rule)."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                       args.tensor_model_parallel_size, logging_enabled=False)


def assert_rope(args, config, hf: dict) -> None:
    assert args.rotary_base == hf["rope_theta"]  # GPTModel(rotary_base=args.rotary_base); MLA configs take it too
    assert getattr(config, "rotary_base", args.rotary_base) == hf["rope_theta"]
    scaling = hf.get("rope_scaling")
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # rotary_pos_embedding.py _apply_scaling: low 1, high 4, original 8192 hardcoded
        assert args.use_rope_scaling and args.rope_scaling_factor == scaling["factor"]
        assert (scaling["low_freq_factor"], scaling["high_freq_factor"],
                scaling["original_max_position_embeddings"]) == (1.0, 4.0, 8192)
    elif kind == "yarn":
        assert config.rope_type == "yarn" and config.rotary_scaling_factor == scaling["factor"]
        assert (config.mscale, config.mscale_all_dim) == (scaling["mscale"], scaling["mscale_all_dim"])
        assert (config.original_max_position_embeddings, config.beta_fast, config.beta_slow) == (
            scaling["original_max_position_embeddings"], scaling["beta_fast"], scaling["beta_slow"])
    else:
        assert not args.use_rope_scaling and getattr(config, "rope_type", "rope") == "rope"


def assert_router(config, hf: dict) -> None:
    experts = hf.get("num_local_experts") or hf.get("n_routed_experts")
    if experts is None:
        assert config.num_moe_experts is None
        return
    assert (config.num_moe_experts, config.moe_router_topk) == (experts, hf["num_experts_per_tok"])
    assert config.moe_router_score_function == hf.get("scoring_func", "softmax")
    assert (config.moe_router_topk_scaling_factor or 1.0) == hf.get("routed_scaling_factor", 1.0)
    groups = hf.get("n_group") if hf.get("n_group", 1) > 1 else None
    assert config.moe_router_num_groups == groups
    assert config.moe_router_group_topk == (hf.get("topk_group") if groups else None)
    normalized = hf.get("norm_topk_prob", True)  # Mixtral has none and renormalises
    assert config.moe_router_pre_softmax == (not normalized and config.moe_router_score_function == "softmax")


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_builds_the_model_of_the_config(megatron, tmp_path, name):
    hf, layout, published_b = CASES[name]
    plan = imported_plan(tmp_path, hf, layout)
    args, config, printout = megatron_config(megatron, plan)
    assert config.layernorm_epsilon == hf["rms_norm_eps"] and config.normalization == "RMSNorm"
    assert config.hidden_dropout == config.attention_dropout == hf.get("attention_dropout", 0.0) == 0.0
    assert config.qk_layernorm == ("kv_lora_rank" in hf)  # DeepSeek's latent norms; none of the others has q/k norms
    assert_rope(args, config, hf)
    if "kv_lora_rank" not in hf:
        assert config.num_query_groups == hf["num_key_value_heads"]
    assert config.add_qkv_bias == (hf["model_type"] == "qwen2") and not config.add_bias_linear
    assert args.untie_embeddings_and_output_weights == (not hf.get("tie_word_embeddings", False))
    assert padded_vocab(args) == hf["vocab_size"]  # no dummy tokens: the model's own vocabulary
    assert_router(config, hf)
    assert total_parameters_b(printout) == pytest.approx(published_b, abs=0.02)


def test_gpt3_keeps_its_dropout_and_pads_its_odd_vocabulary_as_planned(megatron):
    model = load_model("gpt3-175b")
    plan = build_plan(load_cluster("dgx-a100-80g", nodes=8), model, TrainingSpec(global_batch=1536),
                      Layout(tp=8, pp=8, dp=1, zero=0, sequence_parallel=True, recompute="full"))
    args, config, _ = megatron_config(megatron, plan)
    assert config.hidden_dropout == config.attention_dropout == model.dropout == 0.1
    assert config.layernorm_epsilon == model.norm_eps_ and config.normalization == "LayerNorm"
    assert args.position_embedding_type == "learned_absolute" and config.add_bias_linear
    assert padded_vocab(args) == math.ceil(model.vocab / 8) * 8  # what plan3d's memory model counts
