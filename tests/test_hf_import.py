"""`plan3d import-hf`: real Hugging Face config.json contents -> ModelSpec -> parameter counts."""
from __future__ import annotations

import json

import pytest
import yaml

from plan3d.cost.params import total_params
from plan3d.specs.catalog import load_model
from plan3d.specs.hf import DEFAULT_SEQ_LEN, import_hf, read_hf
from cli_helpers import run_cli  # noqa: E402

# config.json contents of published Hugging Face models, written from the Hub files: every shape field
# plan3d reads is as published; unrelated keys are kept to show they are ignored (a few may be trimmed).
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
    "use_cache": True, "vocab_size": 128256,
}
GPT2 = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
    "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
    "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
GPT_NEOX_20B = {  # EleutherAI/gpt-neox-20b
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu_fast",
    "hidden_size": 6144, "initializer_range": 0.02, "intermediate_size": 24576, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 64,
    "num_hidden_layers": 44, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True,
    "use_parallel_residual": True, "vocab_size": 50432,
}
OPT_125M = {  # facebook/opt-125m
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
    "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
}
QWEN25_7B = {  # Qwen/Qwen2.5-7B (model_type qwen2, the Qwen2 architecture)
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064,
}
LLAMA31_8B = {  # meta-llama/Llama-3.1-8B: a 131,072-token context reached by RoPE scaling, pretrained at 8192
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN2_7B = {  # Qwen/Qwen2-7B: q/k/v projections with biases, output and MLP without
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.37.2", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}
BLOOM_560M = {  # bigscience/bloom-560m
    "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"],
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 1024,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True,
    "model_type": "bloom", "n_head": 16, "n_inner": None, "n_layer": 24, "offset_alibi": 100,
    "pad_token_id": 3, "pretraining_tp": 1, "skip_bias_add": True, "skip_bias_add_qkv": False,
    "slow_but_exact": False, "transformers_version": "4.21.0.dev0", "unk_token_id": 0, "use_cache": True,
    "vocab_size": 250880,
}

# (config, published parameter count, where it is published)
PUBLISHED = {
    "llama3-8b": (LLAMA3_8B, 8.03e9, "Hub page of meta-llama/Meta-Llama-3-8B: 8.03B params"),
    "llama-3.1-8b": (LLAMA31_8B, 8.03e9, "Hub page of meta-llama/Llama-3.1-8B: 8.03B params"),
    "qwen2-7b": (QWEN2_7B, 7.62e9, "Hub page of Qwen/Qwen2-7B: 7.62B params"),
    "gpt2": (GPT2, 124e6, "model card of openai-community/gpt2: 124M parameters"),
    "mistral-7b": (MISTRAL_7B, 7.3e9, "Mistral AI, 'Mistral 7B' announcement: a 7.3B parameter model"),
    "gpt-neox-20b": (GPT_NEOX_20B, 20_554_567_680, "model card of EleutherAI/gpt-neox-20b: 20,554,567,680 parameters"),
    "opt-125m": (OPT_125M, 125e6, "Zhang et al. 2022, OPT (arXiv:2205.01068), Table 1: 125M"),
    "qwen2.5-7b": (QWEN25_7B, 7.61e9, "model card of Qwen/Qwen2.5-7B: Number of Parameters 7.61B"),
    "bloom-560m": (BLOOM_560M, 559_214_592, "model card of bigscience/bloom-560m: 559,214,592 parameters"),
}


def write_config(tmp_path, config: dict, folder: str = "model"):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_matches_published_size(tmp_path, name):
    config, published, _source = PUBLISHED[name]
    spec = import_hf(str(write_config(tmp_path, config, name)))
    assert spec.name == name or spec.name == "opt-125m"
    assert abs(total_params(spec) / published - 1) < 0.01, (total_params(spec), published)


def test_family_facts(tmp_path):
    llama = import_hf(str(write_config(tmp_path, LLAMA3_8B, "a")))
    assert (llama.activation, llama.norm, llama.bias, llama.position, llama.kv_heads) == ("swiglu", "rmsnorm", False, "rope", 8)
    assert llama.tied_embeddings is False and llama.ffn_hidden == 14336
    gpt2 = import_hf(str(write_config(tmp_path, GPT2, "b")))
    assert (gpt2.activation, gpt2.position, gpt2.tied_embeddings, gpt2.bias, gpt2.ffn_hidden_) == ("gelu", "learned", True, True, 3072)
    opt = import_hf(str(write_config(tmp_path, OPT_125M, "c")))
    assert (opt.activation, opt.ffn_hidden, opt.name) == ("relu", 3072, "opt-125m")
    bloom = import_hf(str(write_config(tmp_path, BLOOM_560M, "d")))
    assert (bloom.position, bloom.seq_len, bloom.tied_embeddings) == ("alibi", 2048, True)  # BigScience's length
    neox = import_hf(str(write_config(tmp_path, GPT_NEOX_20B, "e")))
    assert (neox.position, neox.tied_embeddings, neox.bias) == ("rope", False, True)


def test_bundled_llama3_8b_agrees_with_its_config(tmp_path):
    imported = import_hf(str(write_config(tmp_path, LLAMA3_8B)))
    assert total_params(imported) == total_params(load_model("llama3-8b"))


def test_moe_config_maps_experts(tmp_path):
    mixtral = LLAMA3_8B | {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    spec = import_hf(str(write_config(tmp_path, mixtral)))
    assert (spec.moe.experts, spec.moe.top_k) == (8, 2)


run = run_cli


def test_cli_writes_a_spec_that_loads(tmp_path, capsys):
    out_path = tmp_path / "mistral.yaml"
    code, out, err = run(capsys, "import-hf", str(write_config(tmp_path, MISTRAL_7B, "Mistral-7B-v0.1")),
                         "-o", str(out_path))
    assert code == 0, err
    assert "wrote" in out and "mistral-7b-v0.1" in out
    loaded = load_model(str(out_path))
    assert loaded == import_hf(str(tmp_path / "Mistral-7B-v0.1" / "config.json"))
    code, out, err = run(capsys, "specs", "show", str(out_path), "--kind", "model")
    assert code == 0 and "parameters" in out


def test_cli_prints_yaml_without_output(tmp_path, capsys):
    code, out, _ = run(capsys, "import-hf", str(write_config(tmp_path, GPT2)), "--name", "my-gpt2", "--seq-len", "512")
    assert code == 0 and "name: my-gpt2" in out and "seq_len: 512" in out


@pytest.mark.parametrize("config, expect", [
    ({"model_type": "mystery", "hidden_size": 512}, ["missing layers", "missing heads", "missing vocab"]),
    ({"model_type": "t5", "is_encoder_decoder": True, "d_model": 512}, ["encoder-decoder"]),
    (LLAMA3_8B | {"hidden_act": "tanh"}, ["activation 'tanh'"]),
    (LLAMA3_8B | {"num_key_value_heads": 5}, ["not divisible by kv_heads=5"]),
    ([1, 2, 3], ["must be a mapping"]),
])
def test_cli_bad_configs_exit_2_one_line_per_problem(tmp_path, capsys, config, expect):
    code, _, err = run(capsys, "import-hf", str(write_config(tmp_path, config)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == len(expect) and "Traceback" not in err
    for line, fragment in zip(lines, expect):
        assert line.startswith("error:") and fragment in line, err


def test_cli_missing_file_asks_for_a_config_not_a_bundled_name(tmp_path, capsys):
    code, _, err = run(capsys, "import-hf", str(tmp_path / "nope" / "config.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no such file" in err and "config.json" in err and "bundled" not in err


def test_cli_accepts_the_model_folder_and_reports_unwritable_output(tmp_path, capsys):
    folder = write_config(tmp_path, QWEN25_7B, "Qwen2.5-7B").parent
    code, out, _ = run(capsys, "import-hf", str(folder))
    assert code == 0 and "name: qwen2.5-7b" in out and "kv_heads: 4" in out
    code, _, err = run(capsys, "import-hf", str(folder), "-o", str(tmp_path))  # a directory
    assert code == 2 and "cannot be written" in err


# ---- the training sequence length is a stated choice, not max_position_embeddings ---------------
def stated_context(config: dict) -> int:
    return config.get("max_position_embeddings") or config["n_positions"]


@pytest.mark.parametrize("config", [LLAMA31_8B, QWEN2_7B, LLAMA3_8B, MISTRAL_7B, GPT2, OPT_125M],
                         ids=["llama3.1", "qwen2", "llama3", "mistral", "gpt2", "opt"])
def test_default_seq_len_is_the_stated_context_capped_at_the_default(tmp_path, config):
    imported = read_hf(str(write_config(tmp_path, config)))
    assert imported.spec.seq_len == min(stated_context(config), DEFAULT_SEQ_LEN)
    [note] = imported.notes
    assert f"seq_len {imported.spec.seq_len:,}" in note and "--seq-len" in note
    if stated_context(config) > DEFAULT_SEQ_LEN:  # the note says what it did not take
        assert f"{stated_context(config):,}" in note


def test_an_explicit_seq_len_is_taken_without_a_note(tmp_path):
    imported = read_hf(str(write_config(tmp_path, LLAMA31_8B)), seq_len=8192)
    assert imported.spec.seq_len == 8192 and imported.notes == []


def test_cli_says_which_seq_len_it_chose_on_stderr_and_in_the_file(tmp_path, capsys):
    import yaml

    code, out, err = run(capsys, "import-hf", str(write_config(tmp_path, LLAMA31_8B, "Llama-3.1-8B")))
    assert code == 0
    assert yaml.safe_load(out)["seq_len"] == DEFAULT_SEQ_LEN  # stdout stays a loadable spec
    note = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "131,072" in note[0] and "--seq-len" in note[0]
    assert note[0] in out  # the written file keeps the note as a comment
    code, out, err = run(capsys, "import-hf", str(tmp_path / "Llama-3.1-8B"), "--seq-len", "8192")
    assert code == 0 and yaml.safe_load(out)["seq_len"] == 8192 and "note:" not in err


def test_learned_positions_refuse_a_longer_seq_len(tmp_path, capsys):
    code, _, err = run(capsys, "import-hf", str(write_config(tmp_path, GPT2)), "--seq-len", "2048")
    assert code == 2 and "n_positions 1024" in err and "--seq-len 1024" in err and "Traceback" not in err


# ---- biases the single `bias` flag cannot express -------------------------------------------------
def qkv_bias_params(config: dict) -> int:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_layer = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return config["num_hidden_layers"] * per_layer


@pytest.mark.parametrize("config", [QWEN2_7B, QWEN25_7B], ids=["qwen2", "qwen2.5"])
def test_qwen2_qkv_biases_are_imported_and_counted(tmp_path, config):
    from plan3d.cost.params import total_params

    imported = read_hf(str(write_config(tmp_path, config)))
    assert (imported.spec.bias, imported.spec.qkv_bias) == (False, True) and imported.warnings == []
    without = imported.spec.model_copy(update={"qkv_bias": None})
    assert total_params(imported.spec) - total_params(without) == qkv_bias_params(config)


def test_llama_with_attention_bias_only_warns_about_the_output_bias_it_cannot_hold(tmp_path):
    imported = read_hf(str(write_config(tmp_path, LLAMA31_8B | {"attention_bias": True})))
    [warning] = imported.warnings
    assert (imported.spec.bias, imported.spec.qkv_bias) == (False, True)
    assert "attention output" in warning and "q/k/v" not in warning
    assert f"{32 * 4096:,} parameters" in warning
    both = read_hf(str(write_config(tmp_path, LLAMA31_8B | {"attention_bias": True, "mlp_bias": True}, "b")))
    assert both.spec.bias is True and both.warnings == []


@pytest.mark.parametrize("config", [LLAMA31_8B, MISTRAL_7B, GPT2, GPT_NEOX_20B], ids=["llama", "mistral", "gpt2", "neox"])
def test_uniform_biases_give_no_warning(tmp_path, config):
    # at most 1024 tokens: inside Mistral's sliding window and GPT-2's position table, so only a
    # bias warning could appear
    assert read_hf(str(write_config(tmp_path, config)), seq_len=1024).warnings == []


def test_cli_writes_qkv_bias_and_prints_a_partial_bias_warning_on_stderr(tmp_path, capsys):
    code, out, err = run(capsys, "import-hf", str(write_config(tmp_path, QWEN2_7B)))
    assert code == 0 and "bias: false" in out and "qkv_bias: true" in out and "warning:" not in err
    code, out, err = run(capsys, "import-hf", str(write_config(tmp_path, LLAMA31_8B | {"attention_bias": True}, "b")))
    assert code == 0 and [line for line in err.splitlines() if line.startswith("warning:") and "attention output" in line]


# ---- red team of issue 19: a folder name is data, never a line of the spec -----------------------
INJECTING_FOLDER = "z\nmoe: {experts: 64, top_k: 8}\n#"


def test_a_folder_name_cannot_add_a_section_to_the_spec(tmp_path, capsys):
    folder = write_config(tmp_path, LLAMA3_8B, INJECTING_FOLDER).parent
    out_path = tmp_path / "model.yaml"
    for source in (folder, folder / "config.json"):
        code, out, err = run(capsys, "import-hf", str(source), "-o", str(out_path))
        assert code == 0, err
        loaded = load_model(str(out_path))
        assert loaded.moe is None and loaded.name == "z-moe-experts-64-top_k-8"
        text = out_path.read_text()
        header = text.split("\nname:")[0].splitlines()
        assert header and all(line.startswith("# ") for line in header), text
    code, out, _ = run(capsys, "import-hf", str(folder))  # printed, not written
    assert code == 0 and "moe" not in yaml.safe_load(out)


@pytest.mark.parametrize("raw, expected", [
    ("Meta-Llama-3-8B", "meta-llama-3-8b"),
    ("org/My Model (v2)", "my-model-v2"),
    ("::error::x", "error-x"),
    ("..\n\x1b[31m", "31m"),
    ("modèle", "mod-le"),
])
def test_default_name_keeps_only_safe_characters(tmp_path, raw, expected):
    from plan3d.specs.hf import default_name

    assert default_name(tmp_path / "config.json", {"_name_or_path": raw}) == expected


@pytest.mark.parametrize("config, expected", [
    (LLAMA3_8B, 0.0),  # attention_dropout 0.0
    (MISTRAL_7B, 0.0),  # none stated: the spec's default
    (GPT2, 0.1),  # resid_pdrop / attn_pdrop / embd_pdrop 0.1
    (BLOOM_560M, 0.0),  # hidden_dropout / attention_dropout 0.0
    (OPT_125M, 0.1),  # dropout 0.1, attention_dropout 0.0: the largest
])
def test_dropout_is_read_from_the_config(tmp_path, config, expected):
    assert import_hf(str(write_config(tmp_path, config))).dropout == expected


def test_differing_dropouts_keep_the_largest_and_warn_naming_the_fields(tmp_path):
    result = read_hf(str(write_config(tmp_path, OPT_125M)))
    warning = next(w for w in result.warnings if "dropout" in w)
    assert "dropout 0.1" in warning and "attention_dropout 0" in warning and "largest (0.1)" in warning
    uniform = read_hf(str(write_config(tmp_path, GPT2, "gpt2")))
    assert not any("dropouts" in w for w in uniform.warnings)


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1", True])
def test_a_dropout_that_is_not_a_probability_is_refused_naming_the_field(tmp_path, capsys, value):
    path = write_config(tmp_path, LLAMA3_8B | {"attention_dropout": value})
    code, _, err = run(capsys, "import-hf", str(path))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "attention_dropout" in err and str(path) in err and "[0, 1)" in err


def test_an_imported_dropout_survives_the_written_spec(tmp_path, capsys):
    out_path = tmp_path / "gpt2.yaml"
    assert run(capsys, "import-hf", str(write_config(tmp_path, GPT2)), "-o", str(out_path))[0] == 0
    assert load_model(str(out_path)).dropout == 0.1
