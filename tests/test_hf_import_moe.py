"""`plan3d import-hf` of mixture-of-experts models: real config.json contents -> MoESpec / MLASpec ->
total and active parameter counts against the numbers the model authors publish (issue 17).

Tolerance: a published figure is matched to the digits it is published with, one unit in its last
digit either way ("671B": 670B to 672B; "46.7B": 46.6B to 46.8B), since publishers round or truncate
(Qwen3-30B-A3B's 3.353B active is published as "3.3B"). What each publisher counts as active differs:
Mistral, Qwen and Meta count every weight a token passes through, the input embedding included;
DeepSeek and OpenAI leave the input embedding (a table lookup) out of their activated counts and
keep the output head (gpt-oss: 5.13B = 4.55B in the blocks + 0.58B unembedding; DeepSeek-V2-Lite's
2.4B is 2.45B without the embedding, 2.66B with it). Each case says which.
"""
from __future__ import annotations

import json
import random

import pytest
import yaml

from plan3d.cost.params import active_params, total_params
from plan3d.specs.catalog import load_model
from plan3d.specs.hf import read_hf
from plan3d.specs.hf_moe import layer_rule
from cli_helpers import run_cli  # noqa: E402

# config.json contents of published Hugging Face models (every field plan3d reads is as on the Hub; a few
# unrelated keys are trimmed: quantization_config, auto_map, token ids).
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}
QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN2_57B_A14B = {  # Qwen/Qwen2-57B-A14B
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2_moe", "moe_intermediate_size": 2560, "norm_topk_prob": False,
    "num_attention_heads": 28, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 20480, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_235B_A22B = QWEN3_30B_A3B | {  # Qwen/Qwen3-235B-A22B: the same keys, these values differ
    "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94, "moe_intermediate_size": 1536,
    "num_attention_heads": 64, "num_hidden_layers": 94,
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
DEEPSEEK_V2 = DEEPSEEK_V2_LITE | {  # deepseek-ai/DeepSeek-V2: the same keys, these values differ
    "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_group": 8,
    "n_routed_experts": 160, "num_attention_heads": 128, "num_hidden_layers": 60, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "routed_scaling_factor": 16.0, "topk_group": 3, "topk_method": "group_limited_greedy",
    "transformers_version": "4.39.3",
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (quantization_config, auto_map trimmed)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
GPT_OSS_20B = {  # openai/gpt-oss-20b (quantization_config trimmed)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
GPT_OSS_120B = GPT_OSS_20B | {  # openai/gpt-oss-120b: the same keys, these values differ
    "layer_types": ["sliding_attention", "full_attention"] * 18, "num_hidden_layers": 36, "num_local_experts": 128,
}
LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E (the language model's keys; token ids trimmed)
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
        "attn_temperature_tuning": 4, "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "max_position_embeddings": 262144, "model_type": "llama4_text",
        "moe_layers": list(range(48)), "no_rope_layers": [1, 1, 1, 0] * 12, "num_attention_heads": 40,
        "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
        "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "use_qk_norm": True,
        "vocab_size": 202048,
    },
    "vision_config": {
        "hidden_act": "gelu", "hidden_size": 1408, "image_size": 336, "intermediate_size": 5632,
        "model_type": "llama4_vision_model", "multi_modal_projector_bias": False, "num_attention_heads": 16,
        "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 4096, "projector_output_dim": 4096, "vision_output_dim": 4096,
    },
}


def llama4_vision_params(config: dict) -> int:
    """Llama 4's vision encoder and projector (HF Llama4VisionModel, Llama4MultiModalProjector), which
    Meta's 109B counts and a text-model spec does not: a ViT with biased linears and LayerNorms, a
    class token and learned positions, a pixel-shuffle MLP adapter and a projector into the text width."""
    v, text_hidden = config["vision_config"], config["text_config"]["hidden_size"]
    h, inner, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    layer = 4 * (h * h + h) + (h * inner + inner) + (inner * h + h) + 2 * 2 * h
    embeddings = v["num_channels"] * patch * patch * h + h + ((v["image_size"] // patch) ** 2 + 1) * h + 2 * 2 * h
    shuffled = int(h / v["pixel_shuffle_ratio"] ** 2)
    adapter = shuffled * v["projector_input_dim"] + v["projector_input_dim"] * v["projector_output_dim"]
    return v["num_hidden_layers"] * layer + embeddings + adapter + v["vision_output_dim"] * text_hidden


def without_input_embedding(spec) -> int:
    return active_params(spec) - spec.vocab * spec.hidden


# name: (config, published total, published active, what the active figure counts, extra total, where published)
PUBLISHED = {
    "mixtral-8x7b": (MIXTRAL_8X7B, "46.7B", "12.9B", active_params, 0,
                     "Mistral AI, 'Mixtral of experts' (2023-12-11): 46.7B total, 12.9B per token"),
    "qwen1.5-moe-a2.7b": (QWEN15_MOE_A27B, "14.3B", "2.7B", active_params, 0,
                          "Qwen blog, 'Qwen1.5-MoE' (2024-03-28): 14.3B parameters, 2.7B activated"),
    "qwen2-57b-a14b": (QWEN2_57B_A14B, "57B", "14B", active_params, 0,
                       "Qwen2 technical report (arXiv:2407.10671), Table 1: 57B total, 14B activated"),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "30.5B", "3.3B", active_params, 0,
                      "model card of Qwen/Qwen3-30B-A3B: 30.5B in total, 3.3B activated"),
    "qwen3-235b-a22b": (QWEN3_235B_A22B, "235B", "22B", active_params, 0,
                        "model card of Qwen/Qwen3-235B-A22B: 235B in total, 22B activated"),
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE, "15.7B", "2.4B", without_input_embedding, 0,
                         "DeepSeek-V2 report (arXiv:2405.04434), appendix B: 15.7B total, 2.4B activated"),
    "deepseek-v2": (DEEPSEEK_V2, "236B", "21B", without_input_embedding, 0,
                    "DeepSeek-V2 report (arXiv:2405.04434): 236B total, 21B activated for each token"),
    # 671B is the main model; the Hub's 685B adds the 14B multi-token-prediction module (not in the spec)
    "deepseek-v3": (DEEPSEEK_V3, "671B", "37B", without_input_embedding, 0,
                    "DeepSeek-V3 report (arXiv:2412.19437): 671B total, 37B activated for each token"),
    "gpt-oss-20b": (GPT_OSS_20B, "20.91B", "3.61B", without_input_embedding, 0,
                    "gpt-oss-120b & gpt-oss-20b model card (arXiv:2508.10925), Table 1: 20.91B total, 3.61B active"),
    "gpt-oss-120b": (GPT_OSS_120B, "116.83B", "5.13B", without_input_embedding, 0,
                     "gpt-oss model card (arXiv:2508.10925), Table 1: 116.83B total, 5.13B active"),
    # Meta's 109B counts the vision encoder (0.87B from vision_config); the spec is the language model
    "llama-4-scout": (LLAMA4_SCOUT, "109B", "17B", active_params, llama4_vision_params(LLAMA4_SCOUT),
                      "model card of meta-llama/Llama-4-Scout-17B-16E: 17B activated, 109B total"),
}


def within_published_digits(measured: float, published: str) -> bool:
    """`measured` (parameters) is `published` ("46.7B") to one unit in its last digit."""
    digits = published.rstrip("B")
    unit = 10.0 ** -(len(digits.split(".")[1]) if "." in digits else 0)
    return abs(measured / 1e9 - float(digits)) < unit


def write_config(tmp_path, config: dict, folder: str = "model"):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def imported(tmp_path, name: str):
    return read_hf(str(write_config(tmp_path, PUBLISHED[name][0], name)))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_total_and_active_parameters_match_the_published_figures(tmp_path, name):
    _config, total, active, counted, extra, _where = PUBLISHED[name]
    spec = imported(tmp_path, name).spec
    assert spec.moe is not None
    assert within_published_digits(total_params(spec) + extra, total), (total_params(spec) + extra, total)
    assert within_published_digits(counted(spec), active), (counted(spec), active)


def test_the_tolerance_rejects_a_missing_component(tmp_path):
    """Dropping the shared experts, the MLA query latent or the first dense layers moves the counts out."""
    v3 = imported(tmp_path, "deepseek-v3").spec
    no_shared = v3.model_copy(update={"moe": v3.moe.model_copy(update={"shared_ffn_hidden": 0})})
    all_moe = v3.model_copy(update={"moe": v3.moe.model_copy(update={"first_dense_layers": 0})})
    assert not within_published_digits(without_input_embedding(no_shared), "37B")
    assert not within_published_digits(total_params(all_moe), "671B")
    lite = imported(tmp_path, "deepseek-v2-lite").spec
    assert not within_published_digits(active_params(lite), "2.4B")  # the embedding is not in DeepSeek's count


@pytest.mark.parametrize("name, moe, extra", [
    ("mixtral-8x7b", {"experts": 8, "top_k": 2, "expert_ffn_hidden": None, "shared_ffn_hidden": 0}, {"ffn_hidden": 14336}),
    ("qwen2-57b-a14b", {"experts": 64, "top_k": 8, "expert_ffn_hidden": 2560, "shared_ffn_hidden": 20480,
                        "shared_expert_gate": True}, {"ffn_hidden": 18944, "qkv_bias": True}),
    ("qwen3-30b-a3b", {"experts": 128, "top_k": 8, "expert_ffn_hidden": 768, "shared_ffn_hidden": 0},
     {"head_dim": 128, "kv_heads": 4}),
    ("deepseek-v2-lite", {"experts": 64, "top_k": 6, "expert_ffn_hidden": 1408, "shared_ffn_hidden": 2 * 1408,
                          "first_dense_layers": 1, "router": "softmax"}, {"ffn_hidden": 10944}),
    ("deepseek-v3", {"experts": 256, "top_k": 8, "expert_ffn_hidden": 2048, "shared_ffn_hidden": 2048,
                     "first_dense_layers": 3, "every": 1, "router": "sigmoid"}, {"ffn_hidden": 18432}),
    ("gpt-oss-120b", {"experts": 128, "top_k": 4, "shared_ffn_hidden": 0}, {"bias": True, "head_dim": 64}),
    ("llama-4-scout", {"experts": 16, "top_k": 1, "expert_ffn_hidden": 8192, "shared_ffn_hidden": 8192,
                       "router": "sigmoid"}, {"ffn_hidden": 16384, "layers": 48}),
])
def test_moe_fields_are_mapped_from_each_family(tmp_path, name, moe, extra):
    spec = imported(tmp_path, name).spec
    assert {k: getattr(spec.moe, k) for k in moe} == moe
    assert {k: getattr(spec, k) for k in extra} == extra
    assert spec.moe.capacity_factor is None  # HF's MoE blocks are dropless


@pytest.mark.parametrize("name, mla", [
    ("deepseek-v3", {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128}),
    ("deepseek-v2-lite", {"q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                          "v_head_dim": 128}),
])
def test_multi_head_latent_attention_is_mapped(tmp_path, name, mla):
    spec = imported(tmp_path, name).spec
    assert spec.mla.model_dump() == mla and spec.head_dim is None


def test_first_dense_layers_and_frequency_follow_deepseek_fields(tmp_path):
    config = DEEPSEEK_V3 | {"first_k_dense_replace": 5, "moe_layer_freq": 2}
    result = read_hf(str(write_config(tmp_path, config)))
    hf_layers = [i for i in range(61) if i >= 5 and i % 2 == 0]
    assert [i for i in range(61) if result.spec.is_moe_layer(i)] == hf_layers
    assert not any("routes" in w for w in result.warnings)


@pytest.mark.parametrize("change, hf_layers", [
    ({"mlp_only_layers": [0, 1, 2]}, list(range(3, 48))),  # a dense prefix: first_dense_layers 3, exact
    ({"decoder_sparse_step": 2}, list(range(1, 48, 2))),  # Qwen's (i + 1) % 2: layers 1, 3, ... 47
    ({"mlp_only_layers": [5, 7]}, [i for i in range(48) if i not in (5, 7)]),
])
def test_qwen_layer_rules_are_exact_or_keep_the_count_and_warn(tmp_path, change, hf_layers):
    result = read_hf(str(write_config(tmp_path, QWEN3_30B_A3B | change)))
    ours = [i for i in range(48) if result.spec.is_moe_layer(i)]
    assert len(ours) == len(hf_layers)  # so total and active parameters are those of the HF model
    warned = [w for w in result.warnings if "routes" in w]
    if ours == hf_layers:
        assert warned == []
    else:
        [warning] = warned
        assert "decoder_sparse_step / mlp_only_layers" in warning and f"{len(hf_layers)} of 48 layers" in warning


def spec_rule(first_dense: int, every: int, layers: int) -> list[bool]:
    return [i >= first_dense and i % every == 0 for i in range(layers)]


def some_rule_is_exact(flags: list[bool]) -> bool:
    layers = len(flags)
    return any(spec_rule(first, every, layers) == flags for every in range(1, layers + 1) for first in range(layers + 1))


@pytest.mark.parametrize("seed", range(4))
def test_layer_rule_is_exact_whenever_a_naive_search_finds_a_rule_and_keeps_the_count(seed):
    rng = random.Random(seed)
    for _ in range(150):
        layers = rng.randint(1, 20)
        if rng.random() < 0.5:
            flags = spec_rule(rng.randint(0, layers), rng.randint(1, layers), layers)
        else:
            flags = [rng.random() < 0.6 for _ in range(layers)]
        if not any(flags):
            continue
        ours = spec_rule(*layer_rule(flags), layers)
        assert sum(ours) == sum(flags), flags
        assert (ours == flags) == some_rule_is_exact(flags), flags


def test_llama4_interleaved_moe_layers_keep_the_count(tmp_path):
    text = LLAMA4_SCOUT["text_config"] | {"interleave_moe_layer_step": 2, "moe_layers": list(range(1, 48, 2))}
    result = read_hf(str(write_config(tmp_path, LLAMA4_SCOUT | {"text_config": text})))
    assert result.spec.moe_layers == 24 and result.spec.moe.every == 2
    assert any("moe_layers / interleave_moe_layer_step" in w for w in result.warnings)


# ---- what the spec cannot hold is named, never dropped ---------------------------------------------
@pytest.mark.parametrize("name, fragments", [
    ("deepseek-v3", ["num_nextn_predict_layers 1", "e_score_correction_bias", "topk_method"]),
    ("gpt-oss-20b", ["sliding_window 128 on 12 of 24 layers", f"{64 * 24:,} parameters", "swiglu_limit 7.0"]),
    ("qwen3-30b-a3b", ["q_norm/k_norm"]),
    ("llama-4-scout", ["no_rope_layers: 12 of 48"]),
])
def test_unmodelled_fields_are_warned_by_name(tmp_path, name, fragments):
    warnings = imported(tmp_path, name).warnings
    for fragment in fragments:
        assert [w for w in warnings if fragment in w], (fragment, warnings)


def test_mixtral_has_nothing_to_warn_about(tmp_path):
    assert imported(tmp_path, "mixtral-8x7b").warnings == []


def test_a_window_only_counts_when_shorter_than_seq_len(tmp_path):
    config = PUBLISHED["llama-4-scout"][0]
    short = read_hf(str(write_config(tmp_path, config)), seq_len=4096).warnings
    long = read_hf(str(write_config(tmp_path, config)), seq_len=16384).warnings
    assert not any("attention_chunk_size" in w for w in short)
    assert any("attention_chunk_size 8192" in w for w in long)


@pytest.mark.parametrize("config, fragment", [
    (MIXTRAL_8X7B | {"num_experts_per_tok": None}, "num_local_experts 8 without num_experts_per_tok"),
    (DEEPSEEK_V3 | {"scoring_func": "sqrtsoftplus"}, 'scoring_func "sqrtsoftplus"'),
    (DEEPSEEK_V3 | {"moe_layer_freq": [0, 1]}, "moe_layer_freq [0, 1] is not a whole number"),
    (DEEPSEEK_V3 | {"v_head_dim": None}, "v_head_dim"),
    (QWEN3_30B_A3B | {"mlp_only_layers": [48]}, "mlp_only_layers must list layer indices from 0 to 47"),
    (QWEN3_30B_A3B | {"num_experts_per_tok": 129}, "top_k=129 exceeds experts=128"),
])
def test_moe_that_cannot_be_modelled_is_refused_in_one_line(tmp_path, capsys, config, fragment):
    code, _, err = run_cli(capsys, "import-hf", str(write_config(tmp_path, config)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("error:") and fragment in lines[0], err


@pytest.mark.parametrize("field", ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                                   "first_k_dense_replace", "moe_layer_freq", "scoring_func", "kv_lora_rank",
                                   "num_nextn_predict_layers", "num_hidden_layers"])
@pytest.mark.parametrize("value", [-1, "8", 1e30, 10**15, True, [3], {"a": 1}])
def test_hostile_moe_values_exit_cleanly(tmp_path, capsys, field, value):
    code, _, err = run_cli(capsys, "import-hf", str(write_config(tmp_path, DEEPSEEK_V3 | {field: value})),
                           "-o", str(tmp_path / "out.yaml"))
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert [line for line in err.splitlines() if line.startswith("error:")] and len(err) < 2000


def test_an_unknown_moe_family_is_read_generically_and_says_so(tmp_path):
    config = DEEPSEEK_V3 | {"model_type": "kimi_k2", "num_nextn_predict_layers": 0}
    result = read_hf(str(write_config(tmp_path, config)))
    assert result.spec.moe == imported(tmp_path, "deepseek-v3").spec.moe
    assert any("'kimi_k2' is not a mixture-of-experts family" in w for w in result.warnings)


# ---- the CLI and the bundled specs ----------------------------------------------------------------
def test_cli_prints_total_and_active_parameters(tmp_path, capsys):
    path = write_config(tmp_path, DEEPSEEK_V3, "DeepSeek-V3")
    spec = read_hf(str(path)).spec
    code, out, err = run_cli(capsys, "import-hf", str(path), "-o", str(tmp_path / "v3.yaml"))
    assert code == 0, err
    assert "671.03B parameters" in out and f"{active_params(spec) / 1e9:.2f}B active per token" in out
    assert load_model(str(tmp_path / "v3.yaml")) == spec
    code, out, err = run_cli(capsys, "import-hf", str(path))  # YAML on stdout, the counts on stderr
    assert code == 0 and yaml.safe_load(out)["moe"]["experts"] == 256
    assert "671.03B parameters" in err and "active per token" in err
    assert "warning: num_nextn_predict_layers 1" in err and "# warning: num_nextn_predict_layers 1" in out


def test_cli_keeps_dense_models_to_one_count(tmp_path, capsys):
    from test_hf_import import LLAMA3_8B

    code, out, _ = run_cli(capsys, "import-hf", str(write_config(tmp_path, LLAMA3_8B)), "-o", str(tmp_path / "l.yaml"))
    assert code == 0 and "8.03B parameters" in out and "active" not in out


@pytest.mark.parametrize("bundled, name", [("mixtral-8x7b", "mixtral-8x7b"), ("deepseek-v3", "deepseek-v3")])
def test_bundled_moe_specs_are_their_config_json(tmp_path, bundled, name):
    spec, hf = load_model(bundled), imported(tmp_path, name).spec
    assert spec.moe == hf.moe and spec.mla == hf.mla
    shape = ("layers", "hidden", "heads", "kv_heads_", "head_dim_", "ffn_hidden_", "vocab", "activation", "norm",
             "bias", "qkv_bias_", "position", "rope_theta", "tied_embeddings")
    assert {k: getattr(spec, k) for k in shape} == {k: getattr(hf, k) for k in shape}
    assert (total_params(spec), active_params(spec)) == (total_params(hf), active_params(hf))
    assert spec.seq_len == 4096 and spec.default_global_batch


def test_specs_list_and_show_give_active_parameters_for_moe(capsys):
    code, out, _ = run_cli(capsys, "specs", "show", "deepseek-v3", "--kind", "model")
    spec = load_model("deepseek-v3")
    assert code == 0 and f"{active_params(spec):,}" in out and f"{total_params(spec):,}" in out
    code, out, _ = run_cli(capsys, "specs", "list", "--json")
    rows = {row["name"]: row for row in json.loads(out) if row["kind"] == "model"}
    assert "37.55B active" in rows["deepseek-v3"]["summary"] and "671.03B params" in rows["deepseek-v3"]["summary"]
    assert "active" not in rows["llama3-8b"]["summary"]


# ---- routing, norms and RoPE scaling the engines build ------------------------------------------
@pytest.mark.parametrize("name, normalize, scaling, groups", [
    ("deepseek-v3", True, 2.5, (8, 4)),  # norm_topk_prob true, routed_scaling_factor 2.5, n_group 8 / topk_group 4
    ("deepseek-v2-lite", False, None, None),  # norm_topk_prob false, scale 1.0, n_group 1
    ("qwen3-30b-a3b", True, None, None),  # norm_topk_prob true
    ("mixtral-8x7b", True, None, None),  # no norm_topk_prob: Mixtral's modeling code renormalises
])
def test_routing_weights_are_imported(tmp_path, name, normalize, scaling, groups):
    moe = imported(tmp_path, name).spec.moe
    assert moe.normalize_top_k is normalize and moe.top_k_scaling == scaling
    assert (None if moe.router_groups is None else (moe.router_groups, moe.router_group_top_k)) == groups


def test_deepseek_v3_keeps_its_epsilon_latent_norms_and_yarn(tmp_path):
    spec = imported(tmp_path, "deepseek-v3").spec
    assert spec.norm_eps == 1e-6 and spec.qk_norm  # rms_norm_eps; q_a_layernorm / kv_a_layernorm
    scaling = spec.rope_scaling
    assert scaling.type == "yarn" and scaling.parameters() == {
        "factor": 40.0, "original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0}


def test_bundled_deepseek_v3_agrees_with_its_config(tmp_path):
    """The bundled spec holds what import-hf reads from the config (the fields engines build from)."""
    spec, bundled = imported(tmp_path, "deepseek-v3").spec, load_model("deepseek-v3")
    for field in ("norm_eps", "qk_norm", "rope_scaling", "rope_theta", "moe", "mla", "layers", "hidden", "vocab"):
        assert getattr(spec, field) == getattr(bundled, field), field
