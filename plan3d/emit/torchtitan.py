"""A torchtitan 0.3.x job for a plan: a Python config function its ConfigManager imports.

torchtitan 0.3 reads no TOML job file. `torchtitan.train` builds its config with
`ConfigManager.parse_args` (torchtitan/config/manager.py): `--module M --config F` imports module
`M` (a registered model such as `llama3`, or any importable module: it tries `M.config_registry`,
then `M` itself), calls `F()` for a `Trainer.Config`, then applies CLI overrides
(`--training.steps 100`). The model (`Trainer.Config.model_spec`) is suppressed from the command
line (trainer.py), so a plan's model shapes can only reach torchtitan through a config function:
that is what this emitter writes. Run it as

    PYTHONPATH=<folder of the file> torchrun ... -m torchtitan.train --module <file stem> --config plan3d_job

torchtitan 0.2.x (`--job.config_file` TOML, `JobConfig`) is a different format: this writes for
0.3.x only (`torchtitan>=0.3,<0.4`, the `engines` extra).

What the plan says, in 0.3.0's own names (torchtitan/config/configs.py, trainer.py,
distributed/fsdp.py, distributed/pipeline_parallel.py):
- data parallelism is FSDP2 over the mesh (pp, dp_replicate, dp_shard, cp, tp), pp slowest and
  tp fastest (distributed/parallel_dims.py `build_mesh`), plan3d order `tp-cp-ep-dp-pp`.
  ZeRO-3: `data_parallel_shard_degree = dp`, `fsdp_reshard_after_forward = "always"` (the
  "default" policy does not reshard when a pipeline is on: `get_fsdp_reshard_after_forward_policy`);
  ZeRO-2: shard degree dp, `"never"` (parameters stay gathered from forward to backward); ZeRO-0:
  `data_parallel_replicate_degree = dp` (replication; composes with tp and pp in 0.3), `"never"`.
  ZeRO-1 (optimizer states sharded, parameters and gradients replicated) has no setting.
- `enable_sequence_parallel` = the plan's sequence parallelism (0.3 defaults it on).
- the stage split is always explicit, `module_fqns_per_model_part` in stage order: stage k*pp + r
  on pipeline rank r (`_get_pp_rank_to_stage_indices_mapping`, loop style; stages r and 2pp-1-r
  for ZBVZeroBubble and DualPipeV, V style, as plan3d's cost model places them), the embedding in the first stage
  and the final norm and output head in the last, next to the plan's layer counts. (torchtitan's
  own split counts the embedding and the head as one layer each, and `pipeline_parallel_layers_per_stage`
  needs ceil((layers + 2) / per_stage) divisible by pp: an explicit split avoids both.)
  `pipeline_parallel_schedule`: the plan's schedule by its torch name (bundled/pipeline_schedules.yaml:
  1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); `training.disable_cuda_graphs`
  with pp > 1 (Trainer.Config refuses CUDA graphs with pipelining).
- batch: with a pipeline `local_batch_size` = global / dp split into micro-batches of
  `pipeline_parallel_microbatch_size`; without one `local_batch_size` = micro-batch and torchtitan
  accumulates global / (local * dp) steps.
- recompute: `FullAC`, `SelectiveAC` (per-op: saves matmul and attention outputs, recomputes
  every second matmul) or none; attention is FlexAttention (`attn_backend="flex"`: one fused
  kernel, scores never reach HBM; 0.3 refuses `sdpa` for language models,
  models/common/config_utils.py `get_attention_config`).
- the torchtitan-compile profile switches `compile.enable` on (model and loss).
- fp8: torchao float8 training through torchtitan's `Float8LinearConverter`
  (components/quantization/float8.py; `model_registry(flavor, converters=[...])`, which builds
  each converter and applies it to the model config): every layer `Linear` becomes a
  `Float8Linear` (recipe "rowwise", the 0.3 default: dynamic per-row scales), `lm_head` kept in
  bf16 (`filter_fqns`), as the time model keeps the output layer; `model_compile_enabled` follows
  the profile. torchao must be installed where the job runs (the converter imports it), and the
  converter refuses GPUs before SM 8.9.

The model is a registered llama3 flavor when the shapes are one (models/llama3/__init__.py),
otherwise the same builder with the plan's layers, width, heads, KV heads, FFN and vocabulary.
Refused (InfeasibleError, exit 1) with what to change: what the profile cannot run
(`target_engine`, which reads the profile's `can_run.models` as `recommend --engine` does: a
model that is not Llama-shaped, torchtitan 0.3 having no LayerNorm/GELU/learned-position decoder,
and a dense model's head dimension other than hidden / heads), tied embeddings with pp > 1 and
fp16 (0.3 raises on both). MoE plans: a DeepSeek-V3-shaped model (MLA, shared experts, first dense
layers) through torchtitan's deepseek_v3 builder with `expert_parallel_degree`, where plan3d's
expert placement maps (plan3d/emit/torchtitan_moe.py); the rest is refused naming what is missing.
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.emit import torchtitan_moe
from plan3d.emit.common import Emitted, target_engine
from plan3d.errors import InfeasibleError
from plan3d.layout import Layout
from plan3d.plan import Plan
from plan3d.specs import schedule as schedules
from plan3d.specs.model import ModelSpec

VERSIONS = "0.3.x"
CONFIG_FUNCTION = "plan3d_job"
DEFAULT_MODULE = "plan3d_job"
ROPE_THETA = 500000  # every torchtitan 0.3 llama3 flavor (models/llama3/__init__.py); used when the spec has none
ROPE_MAX_SEQ_LEN = 131072  # the flavors' RoPE cache length
# Every llama3 flavor is Llama 3.1's: ComplexRoPE scaling "llama" at RoPE.Config's defaults (models/common/rope.py)
FLAVOR_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}


@dataclass(frozen=True)
class Flavor:
    """A registered torchtitan 0.3.0 llama3 flavor (models/llama3/__init__.py `llama3_configs`)."""

    name: str
    recipe: str  # the config_registry function whose data set, optimizer and schedule the job starts from
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    tied: bool = False


FLAVORS = (
    Flavor("1B", "llama3_8b", 16, 2048, 32, 8, 8192, 128256, tied=True),
    Flavor("3B", "llama3_8b", 28, 3072, 24, 8, 8192, 128256, tied=True),
    Flavor("8B", "llama3_8b", 32, 4096, 32, 8, 14336, 128256),
    Flavor("70B", "llama3_70b", 80, 8192, 64, 8, 28672, 128256),
    # llama3_405b's recipe builds a Float8LinearConverter (it needs torchao and trains the model in
    # fp8 whatever the plan's precision): the 405B job starts from the 70B recipe (its optimizer:
    # lr 1.5e-4, where the 405B recipe has 8e-5 and 600 warm-up steps) with the 405B model.
    Flavor("405B", "llama3_70b", 126, 16384, 128, 8, 53248, 128256),
)


def emit_torchtitan(plan: Plan, compile: bool | None = None, module: str = DEFAULT_MODULE) -> Emitted:
    """The config-function module for `plan`; `compile` None follows the plan's engine profile."""
    if compile is None:
        compile = plan.engine is not None and plan.engine.name == "torchtitan-compile"
    profile = "torchtitan-compile" if compile else "torchtitan"
    _, notes = target_engine(plan, profile, VERSIONS)
    _check_expressible(plan)
    flavor = matching_flavor(plan.model)
    notes += _notes(plan, flavor)
    fp8 = plan.training.precision == "fp8"
    body = [_header(plan, profile, module), _imports(flavor, fp8, plan.model.moe is not None),
            _function(plan, flavor, compile)]
    return Emitted("\n".join(body), notes)


def matching_flavor(model: ModelSpec) -> Flavor | None:
    """The registered llama3 flavor with exactly the model's shapes, if any."""
    shapes = (model.layers, model.hidden, model.heads, model.kv_heads_, model.ffn_hidden_, model.vocab,
              model.tied_embeddings)
    if rope_theta(model) != ROPE_THETA or model.moe is not None or model.mla is not None:
        return None
    if model.rope_scaling is None or model.rope_scaling.parameters() != FLAVOR_ROPE_SCALING:
        return None  # Llama 3 (no scaling) or another scaling: the builder with the spec's RoPE
    for flavor in FLAVORS:
        if shapes == (flavor.layers, flavor.hidden, flavor.heads, flavor.kv_heads, flavor.ffn_hidden,
                      flavor.vocab, flavor.tied):
            return flavor
    return None


def rope_theta(model: ModelSpec) -> float:
    """The RoPE base the job builds with: the spec's, else Llama 3's."""
    return model.rope_theta or ROPE_THETA


def _check_expressible(plan: Plan) -> None:
    model, layout = plan.model, plan.layout  # its decoders' parts: can_run.models, refused by target_engine
    if model.moe is not None or layout.ep > 1 or model.mla is not None:
        _check_moe(plan)
    if model.tied_embeddings and layout.pp > 1:  # models/common/decoder.py update_from_config raises
        raise InfeasibleError(f"torchtitan {VERSIONS} does not tie embeddings with pipeline parallelism "
                              "('Weight tying is not supported with Pipeline Parallel'); re-plan with pp=1")
    plan.cluster.gpu.require_precision(plan.training.precision)  # fp8 needs FP8 units
    if plan.training.precision == "fp16":  # TrainingConfig.mixed_precision_param: "bfloat16" | "float32"
        raise InfeasibleError(f"torchtitan {VERSIONS} trains in bf16 or fp32 (training.mixed_precision_param); "
                              "re-plan with --precision bf16")
    _check_schedule(plan)


def _check_moe(plan: Plan) -> None:
    """MoE and MLA plans go through torchtitan's deepseek_v3 builder (plan3d.emit.torchtitan_moe)."""
    model = plan.model
    problems = torchtitan_moe.moe_problems(plan)
    if model.moe is None and model.mla is not None:
        problems.append("its MLA decoder is deepseek_v3's MLA + MoE builder; the spec has no experts")
    if plan.training.precision == "fp8":
        problems.append("this emitter writes fp8 (Float8LinearConverter) for the llama3 builder only")
    if problems:
        raise InfeasibleError(f"torchtitan {VERSIONS} cannot build {model.name} as planned: " + "; ".join(problems)
                              + "; emit megatron for it")


def _check_schedule(plan: Plan) -> None:
    """torch.distributed.pipelining's own limits on the micro-batch count (torch 2.x schedules.py)."""
    layout = plan.layout
    if layout.pp == 1:
        return
    micro = layout.micro_batches(plan.training.global_batch)
    if layout.vpp == 1 and micro < layout.pp:
        raise InfeasibleError(f"torch's Schedule1F1B needs at least pp={layout.pp} micro-batches per step, the "
                              f"plan has {micro}: raise the global batch or lower the micro-batch")
    rounds = max(1, micro // layout.pp)
    if layout.vpp > 1 and micro % rounds:
        raise InfeasibleError(f"torch's Schedule{torch_schedule(layout)} needs the {micro} micro-batches to be a multiple "
                              f"of {rounds} rounds (micro-batches // pp): make them a multiple of pp={layout.pp}")


def _notes(plan: Plan, flavor: Flavor | None) -> list[str]:
    notes = torchtitan_moe.moe_notes(plan)
    if flavor is None and plan.model.moe is None:
        scaling = plan.model.rope_scaling
        rope = f"RoPE theta {rope_theta(plan.model):g}, " + (f"{scaling.type} scaling x{scaling.factor:g}" if scaling
                                                              else "no scaling (the flavors are Llama 3.1's, scaled x8)")
        notes.append(f"{plan.model.name} is no registered torchtitan llama3 flavor: the job builds it with "
                     f"torchtitan's llama3 builder ({rope}); point "
                     f"hf_assets_path at a tokenizer with {plan.model.vocab} tokens")
    if plan.training.precision == "fp8":
        notes.append("fp8: torchao float8 (Float8LinearConverter, recipe 'rowwise') on the layers' Linear modules, "
                      "lm_head in bf16; install torchao where the job runs")
        if plan.engine is None or plan.engine.name != "torchtitan-compile":
            notes.append("fp8 without torch.compile runs torchao's casts as separate kernels: expect a slower "
                         "step than predicted; plan with --engine torchtitan-compile")
    if plan.layout.recompute == "selective" and (plan.engine is None or plan.engine.runs_as.selective != "per-op"):
        notes.append("torchtitan's selective recompute is per-op (it saves every other matmul's output and the "
                     "attention's, and recomputes the rest), not the attention-only recompute this plan was "
                     "predicted with: re-estimate with --engine torchtitan")
    return notes


def _header(plan: Plan, profile: str, module: str) -> str:
    cluster, layout = plan.cluster, plan.layout
    per_node = min(layout.world_size, cluster.gpus_per_node)
    nodes = -(-layout.world_size // per_node)
    return (
        f'"""torchtitan {VERSIONS} job for plan3d plan {plan.digest} ({layout.short()}, profile {profile}).\n\n'
        f"A config function torchtitan's ConfigManager imports; save this file as {module}.py and run on\n"
        f"each of the {nodes} node(s), NODE_RANK 0..{nodes - 1} (static rendezvous: the plan's rank map):\n\n"
        f"    PYTHONPATH=<folder of {module}.py>:$PYTHONPATH torchrun --nnodes {nodes} "
        f"--nproc-per-node {per_node} \\\n"
        f"        --node-rank $NODE_RANK --rdzv-backend static --master-addr $MASTER_ADDR --master-port 29500 \\\n"
        f"        -m torchtitan.train --module {module} --config {CONFIG_FUNCTION}\n\n"
        "or let `plan3d emit torchrun|slurm PLAN --engine torchtitan` write the whole job script.\n"
        "Data set, tokenizer (hf_assets_path), optimizer, steps and checkpoints come from torchtitan's\n"
        "recipe named below: change them here or on the command line (e.g. --training.steps 100).\n"
        '"""\n'
    )


def _imports(flavor: Flavor | None, fp8: bool = False, moe: bool = False) -> str:
    recipe = flavor.recipe if flavor else "llama3_8b"
    lines = ["import dataclasses", ""] if flavor is None and not moe else []
    lines += [
        "from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss",
        *(["from torchtitan.components.quantization import Float8LinearConverter"] if fp8 else []),
        "from torchtitan.config import CompileConfig, ParallelismConfig",
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
        "from torchtitan.models.common.config_utils import decoder_vocab_size",
        "from torchtitan.trainer import Trainer",
    ]
    if moe:
        return "\n".join(torchtitan_moe.imports() + lines) + "\n"
    lines.insert(-1, f"from torchtitan.models.llama3.config_registry import {recipe} as recipe")
    if flavor:
        lines.append("from torchtitan.models.llama3 import model_registry")
    else:
        lines += ["import torchtitan.models.llama3 as llama3",
                  "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm"]
    return "\n".join(lines) + "\n"


def _function(plan: Plan, flavor: Flavor | None, compile: bool) -> str:
    converter = float8_converter(compile) if plan.training.precision == "fp8" else None
    if plan.model.moe is not None:
        model_lines = torchtitan_moe.model_lines(plan, _rope_cache_len(plan))
    else:
        model_lines = _flavor_model(flavor, converter) if flavor else _custom_model(plan, converter)
    return (
        f"\ndef {CONFIG_FUNCTION}() -> Trainer.Config:\n"
        "    config = recipe()\n"
        + "".join(f"    {line}\n" for line in model_lines)
        + "    config.loss = ChunkedLossWrapper.Config(\n"
        "        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec)))\n"
        + _call_block("config.parallelism = ParallelismConfig", parallelism_settings(plan))
        + "".join(f"    config.training.{key} = {value!r}\n" for key, value in training_settings(plan).items())
        + f"    config.activation_checkpoint = {_activation_checkpoint(plan.layout)}\n"
        + f"    config.compile = CompileConfig(enable={compile!r})\n"
        "    return config\n"
    )


def _call_block(target: str, kwargs: dict) -> str:
    body = "".join(f"        {key}={_literal(value)},\n" for key, value in kwargs.items())
    return f"    {target}(\n{body}    )\n"


def _literal(value) -> str:
    """A Python literal; a list of lists one inner list a line (the stage split)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "[\n" + "".join(f"            {inner!r},\n" for inner in value) + "        ]"
    return repr(value)


def float8_converter(compile: bool) -> str:
    """torchtitan 0.3's float8 converter config: layer Linears in FP8, the output head in bf16."""
    return f'Float8LinearConverter.Config(filter_fqns=["lm_head"], model_compile_enabled={compile!r})'


def _flavor_model(flavor: Flavor, converter: str | None = None) -> list[str]:
    if converter is None:
        return [f'config.model_spec = model_registry("{flavor.name}", attn_backend="flex")']
    return [f'config.model_spec = model_registry("{flavor.name}", attn_backend="flex",',
            f"                                  converters=[{converter}])"]


def _custom_model(plan: Plan, converter: str | None = None) -> list[str]:
    """The plan's shapes through torchtitan 0.3.0's own llama3 builder (what its flavors call)."""
    model = plan.model
    seq = _rope_cache_len(plan)
    dim, vocab = model.hidden, model.vocab
    return [
        "model = llama3.Llama3Model.Config(",
        f"    dim={dim}, vocab_size={vocab}, enable_weight_tying={model.tied_embeddings!r},",
        (f"    tok_embeddings=Embedding.Config(num_embeddings={vocab}, embedding_dim={dim}, "
         "param_init=llama3._EMBEDDING_INIT),"),
        f"    norm=RMSNorm.Config(normalized_shape={dim}, param_init=llama3._NORM_INIT),",
        (f"    lm_head=Linear.Config(in_features={dim}, out_features={vocab}, "
         f"param_init=llama3._output_linear_init({dim})),"),
        "    layers=llama3._build_llama3_layers(",
        f"        n_layers={model.layers}, dim={dim}, n_heads={model.heads}, n_kv_heads={model.kv_heads_},",
        f"        hidden_dim={model.ffn_hidden_}, fuse_qkv=True, attn_backend=\"flex\",",
        (f"        rope=ComplexRoPE.Config(dim={model.head_dim_}, max_seq_len={seq}, "
         f"theta={rope_theta(model)!r}, {rope_scaling_args(model)}),"),
        "    ),",
        ")",
        *([f"model = {converter}.build().convert(model)  # what model_registry(converters=...) does"]
          if converter else []),
        f'config.model_spec = dataclasses.replace(llama3.model_registry("8B"), flavor="{model.name}", model=model)',
    ]


def rope_scaling_args(model: ModelSpec) -> str:
    """ComplexRoPE.Config's scaling keywords for the spec's RoPE: none, or Llama 3.1's "llama"
    with its four parameters (the profile refuses the rest)."""
    scaling = model.rope_scaling
    if scaling is None:
        return 'scaling="none"'
    return (f'scaling="llama", scaling_factor={scaling.factor!r}, low_freq_factor={scaling.value("low_freq_factor")!r}, '
            f'high_freq_factor={scaling.value("high_freq_factor")!r}, '
            f'original_max_position_embeddings={int(scaling.value("original_max_position"))}')


def _rope_cache_len(plan: Plan) -> int:
    return max(ROPE_MAX_SEQ_LEN, plan.training.seq_len or plan.model.seq_len)


def parallelism_settings(plan: Plan) -> dict:
    """`ParallelismConfig` keyword arguments (torchtitan/config/configs.py) for the plan's layout."""
    layout = plan.layout
    sharded = layout.zero >= 2
    out = {
        "data_parallel_replicate_degree": 1 if sharded else layout.dp,
        "data_parallel_shard_degree": layout.dp if sharded else 1,
        "fsdp_reshard_after_forward": "always" if layout.zero == 3 else "never",
        "tensor_parallel_degree": layout.tp,
        "enable_sequence_parallel": layout.sequence_parallel,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
    }
    if layout.ep > 1:
        out["expert_parallel_degree"] = layout.ep
    if layout.pp > 1:
        out |= {"pipeline_parallel_schedule": torch_schedule(layout),
                "pipeline_parallel_microbatch_size": layout.micro_batch,
                "module_fqns_per_model_part": stage_modules(layout, plan.model.layers)}
    return out


def torch_schedule(layout: Layout) -> str:
    """The plan's schedule as torch.distributed.pipelining names it (get_schedule_class), from the
    schedule table; a schedule torch lacks (DualPipe) is refused."""
    name = schedules.schedules()[layout.pipeline_schedule].torch
    if name is None:
        raise InfeasibleError(f"torch.distributed.pipelining has no {layout.pipeline_schedule} schedule: re-plan with "
                              "--engine torchtitan, which searches only the schedules it runs")
    return name


def stage_modules(layout: Layout, layers: int) -> list[list[str]]:
    """Module names per virtual stage: the plan's layer counts, embedding first, norm and head last."""
    parts, first = [], 0
    for count in layout.stage_layers(layers):
        parts.append([f"layers.{i}" for i in range(first, first + count)])
        first += count
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "lm_head"]
    return parts


def training_settings(plan: Plan) -> dict:
    """`config.training` values (TrainingConfig): batch, sequence, precision, CUDA graphs."""
    layout, training = plan.layout, plan.training
    out = {
        # with a pipeline the local batch is split into micro-batches; without one, torchtitan
        # accumulates gradients over global / (local * dp) steps (trainer.py)
        "local_batch_size": training.global_batch // layout.dp if layout.pp > 1 else layout.micro_batch,
        "global_batch_size": training.global_batch,
        "seq_len": training.seq_len or plan.model.seq_len,
        "mixed_precision_param": "float32" if training.precision == "fp32" else "bfloat16",
    }
    if layout.pp > 1 or plan.model.moe is not None:  # MoE: as torchtitan's deepseek_v3 recipes
        out["disable_cuda_graphs"] = True
    return out


def _activation_checkpoint(layout: Layout) -> str:
    return {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[layout.recompute]
