"""Published training runs (../shared/data/published/runs.yaml) as plan3d inputs.

Each run becomes (cluster, model, training, engine, layout knobs, measured step time). The rules,
stated once here (see the data README):

- Step time: `measured.iteration_time_s` (or `_ms`) where the source gives it, else
  `derived.iteration_time_s` (computed by the data set from the source's own FLOP convention),
  else the step time implied by a published MFU under the source's convention (Megatron-Core's
  `num_floating_point_operations` for its README table, PaLM's 6N + 12 L h s per token for
  GLM-130B). Runs whose throughput has no stated FLOP convention (OPT, GPT-NeoX, Megatron 2019)
  give no step time: listed as excluded, with the reason.
- Engine: the software that ran it (Megatron-LM 2020-2022, Megatron-Core, Megatron-DeepSpeed,
  DeepSpeed ZeRO-3).
- Hardware: the bundled cluster of that GPU (DGX A100 40/80 GB, DGX H100, DGX-2 for V100),
  sized to the run's GPU count.
- Knobs a source does not state (micro-batch, interleaving depth, recompute, sequence
  parallelism, the ZeRO stage where the data says "not stated") are resolved as the publisher would have tuned them: the fastest predicted
  choice that fits in memory among those the engine can run. Which knobs were resolved is kept
  with each run.

Held-out rows (`load_extra`, data/extra_runs.yaml: published MoE, FP8 and context-parallel runs)
are read by the same rules, with their step time from `measured.iteration_time_s` or the data
set's `derived.iteration_time_s`. They are never fitted; a row plan3d cannot express (a GPU
without a cluster spec, expert tensor parallelism different from tp, an expert-parallel degree
that does not divide dp*cp, a model the data marks `excluded`) is excluded with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from plan3d.layout import Layout
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "published" / "runs.yaml"
EXTRA = Path(__file__).resolve().parent / "data" / "extra_runs.yaml"
PEAK = {"a100": 312e12, "h100": 989e12, "v100": 125e12}
EXTRA_CLUSTERS = {"h100": "dgx-h100", "h800": "h800", "gb200": "gb200-nvl72",
                  "a100": "dgx-a100-80g"}  # GPU kind -> bundled cluster (Azure NDm A100 v4: DGX A100's 8 x 200 Gbit/s)
# The software of a held-out row -> the engine profile it is predicted with (first match; rows of
# software without a profile, DeepSeek's HAI-LLM, get megatron-core's and stay out of the bands).
EXTRA_ENGINES = (("deepspeed", "deepspeed-0.19"),  # DeepSpeed 0.6+ ZeRO-3: bucketed all-gathers (the 2022-on code)
                 ("megatron", "megatron-core"))
# What a framework without a profile of its own runs, as its source states it, on top of the
# profile it is predicted with (that profile's values for everything the source does not state).
FRAMEWORK_CHANGES = {
    # DeepSeek-V3 report sec. 3.2.1: DualPipe, forward and backward chunks of two micro-batches
    # overlapped so the all-to-all hides behind computation; sec. 3.2.2: 20 of the H800's 132 SMs
    # run the communication, each token sent over IB once per node it reaches and forwarded over
    # NVLink (the kernels DeepSeek released as DeepEP: plan3d's deepep dispatcher)
    "hai-llm": {"can_run": {"schedules": ["1f1b", "interleaved-1f1b", "dualpipe"],
                            "ep_dispatchers": ["alltoall", "deepep"]},
                "runs_as": {"f_b_overlap": True, "f_b_comm_sm_share": 0.1515, "ep_dispatcher": "deepep"}},
}


@dataclass
class Run:
    id: str
    source: str
    engine: str
    cluster: str  # bundled cluster name
    gpus: int
    model: ModelSpec
    training: TrainingSpec
    knobs: dict  # Layout fields the source states
    unknown: tuple[str, ...]  # knobs to resolve (micro_batch, vpp, recompute, sequence_parallel)
    measured_s: float
    how_measured: str
    pair_of: str | None = None  # held-out FP8 rows: the BF16 run they are compared with
    vpp_choices: tuple[int, ...] | None = None  # interleaving depths to try when unstated (None: 1, 2, 3, 4, 6, 8)
    measured_alt_s: float | None = None  # held-out: the step time under the other reading of the FLOP count
    framework: str = ""  # the software that ran it, as the source names it (held-out rows)
    dispatcher: str = "alltoall"  # the MoE token dispatcher it ran (RunsAs.ep_dispatcher; held-out rows)
    ep_overlap: str = "none"  # how it hid the all-to-alls (RunsAs.ep_overlap; held-out rows)
    act_offload: str = "none"  # the activations it offloaded to host memory (RunsAs.act_offload; held-out rows)
    measured_dropless_s: float | None = None  # held-out forced-balance rows: the same run with dropless routing

    @property
    def framework_key(self) -> str:
        """The FRAMEWORK_CHANGES entry of its software ('' : none)."""
        return next((key for key in FRAMEWORK_CHANGES if key in self.framework.lower()), "")

    @property
    def ran_on_engine(self) -> bool:
        """Whether the software that ran it is the engine it is predicted with (held-out rows of a
        framework without a profile, DeepSeek's HAI-LLM, are predicted with megatron-core's)."""
        return not self.framework or self.engine.split("-")[0] in self.framework.lower()


def load(path: Path = DATA) -> tuple[list[Run], list[tuple[str, str]]]:
    """(runs with a step time, [(id, why excluded)])."""
    data = yaml.safe_load(path.read_text())
    runs, excluded = [], []
    for row in data["runs"]:
        try:
            runs.append(to_run(row))
        except Excluded as why:
            excluded.append((row["id"], str(why)))
    return runs, excluded


class Excluded(Exception):
    """A run that cannot be turned into a step-time measurement (the reason is the message)."""


def to_run(row: dict, require_time: bool = True) -> Run:
    """The run of a runs.yaml row; `require_time=False` keeps a row without a step time (its
    measured_s is nan and how_measured says why), for what does not need one (benchmarks/memory.py)."""
    source, m, par, batch, train = (row["source"]["ref"], row["model"], row["parallelism"], row["batch"],
                                    row["training"])
    gpu = gpu_kind(row["hardware"]["gpu"])
    model = model_of(row, m)
    gb = int(batch["global_batch_seqs"])
    precision = "bf16" if "bf16" in (str(train.get("precision")) + str(train.get("framework"))).lower() else "fp16"
    # the gradient buffer is the engine's (engine runs_as.gradients): Megatron-LM and DeepSpeed keep
    # fp16 gradients with fp16 and accumulate in fp32 with bf16
    training = TrainingSpec(global_batch=gb, precision=precision)
    engine = engine_of(source, row)
    knobs, unknown = knobs_of(row, par, batch, train, engine)
    try:
        measured, how = step_time(row, model, gb, gpu)
    except Excluded as why:
        if require_time:
            raise
        measured, how = float("nan"), str(why)
    return Run(id=row["id"], source=source, engine=engine, cluster=cluster_of(gpu, row), gpus=int(row["hardware"]["num_gpus"]),
               model=model, training=training, knobs=knobs, unknown=unknown, measured_s=measured,
               how_measured=how)


def gpu_kind(text: str) -> str:
    text = text.lower()
    for kind in ("a100", "h100", "v100"):
        if kind in text:
            return kind
    raise Excluded(f"GPU {text!r} has no bundled spec")


def cluster_of(gpu: str, row: dict) -> str:
    if gpu == "v100":
        return "dgx-2"
    if gpu == "h100":
        return "dgx-h100"
    hw = str(row["hardware"]["gpu"]).lower()
    # DGX A100 shipped with 40 GB in 2020; the 80 GB part came in 2021
    return "dgx-a100-40g" if "40gb" in hw or row["source"]["ref"] == "megatron_readme_2020" else "dgx-a100-80g"


def model_of(row: dict, m: dict) -> ModelSpec:
    arch = str(m.get("arch", "")).lower()
    gated = "geglu" in arch or "swiglu" in arch
    position = "alibi" if row["source"]["ref"] == "bloom_tr11" else "rope" if "rope" in arch else "learned"
    # dropout: Megatron-LM's default 0.1 (hidden and attention), which these GPT runs and BLOOM inherit
    # (tr11 README: "The default Megatron-LM dropout settings are inherited"); GPT-NeoX-20B sets both
    # to 0 (configs/20B.yml, regularization)
    return ModelSpec(name=row["id"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                     kv_heads=m.get("kv_heads"), ffn_hidden=m.get("ffn_hidden"),
                     activation="swiglu" if gated else "gelu", vocab=int(m["vocab"]), seq_len=m["seq_len"],
                     position=position, tied_embeddings=True,
                     dropout=0.0 if row["source"]["ref"] == "gptneox" else 0.1)


def engine_of(source: str, row: dict) -> str:
    zero = str(row["parallelism"].get("zero", "")).lower()
    if "zero-3" in zero:
        return "deepspeed"
    if source in ("narayanan2021", "korthikanti2022", "megatron_readme_2020", "megatron_readme_2019"):  # Megatron-LM's own code
        return "megatron-lm-2021"
    if source == "megatron_readme_h100":
        return "megatron-core"
    return "megatron-deepspeed"  # BLOOM, MT-NLG, GLM-130B (DeepSpeed pipeline + Megatron TP)


FINE_GRAINED = {  # Megatron-Core --recompute-modules lists as the sources write them -> plan3d's mode
    frozenset({"layernorm", "moe"}): "moe", frozenset({"moe_act", "layernorm"}): "moe-act",
    frozenset({"norm", "act"}): "moe-act",
    # DeepSeek-V3 (sec. 3.2.3: RMSNorm and MLA up-projection; sec. 3.3.2: the SwiGLU output from its cached input)
    frozenset({"rmsnorm and mla up-projection"}): "mla-up",
}


def fine_grained_mode(text: str) -> str | None:
    """The plan3d recompute mode of a fine-grained module list ("layernorm, moe (fine-grained)")."""
    if "fine-grained" not in text:
        return None
    modules = frozenset(m.strip() for m in text.split("(")[0].split(","))
    return FINE_GRAINED.get(modules)


def recompute_of(text) -> str | None:
    text = str(text).lower()
    if text.startswith("selective"):
        return "selective"
    if text.startswith(("full", "yes")):
        return "full"
    return None


def knobs_of(row: dict, par: dict, batch: dict, train: dict, engine: str) -> tuple[dict, tuple[str, ...]]:
    zero = str(par.get("zero", "")).lower()
    knobs = {"tp": int(par["tp"]), "pp": int(par["pp"]), "dp": int(par["dp"]),
             "zero": 3 if "zero-3" in zero else 1 if ("zero-1" in zero or "distributed" in zero) else 0}
    if engine == "megatron-core":
        knobs["zero"] = 1  # the README table's runs use the distributed optimizer (stated for the weak-scaling rows)
    if knobs["dp"] == 1:
        knobs["zero"] = 0
    unknown = []
    if "not stated" in zero and knobs["dp"] > 1:
        unknown.append("zero")  # resolved like the other unstated knobs (GLM-130B)
    mb = batch.get("micro_batch")
    if isinstance(mb, int):
        knobs["micro_batch"] = mb
    else:
        unknown.append("micro_batch")
    vpp = par.get("vpp")
    schedule = str(par.get("pipeline_schedule", "")).lower()
    if isinstance(vpp, int):
        knobs["vpp"] = vpp
    elif knobs["pp"] > 1 and engine in ("megatron-lm-2021", "megatron-core"):
        plain_1f1b = "1f1b" in schedule and "interleaved" not in schedule
        if not plain_1f1b:
            unknown.append("vpp")  # PTD-P's interleaving depth, not stated
    recompute = recompute_of(train.get("activation_recompute"))
    if recompute is None and engine == "megatron-lm-2021":
        recompute = "full"  # Megatron-LM's 2019-2021 example scripts all set --checkpoint-activations
    if recompute:
        knobs["recompute"] = recompute
    else:
        unknown.append("recompute")
    sp = par.get("sequence_parallel")
    if isinstance(sp, bool):
        knobs["sequence_parallel"] = sp and knobs["tp"] > 1
    elif knobs["tp"] > 1 and engine == "megatron-core":
        unknown.append("sequence_parallel")
    return knobs, tuple(unknown)


def model_flops_megatron(model: ModelSpec, gb: int) -> float:
    """Megatron-Core num_floating_point_operations (r0.8): 12 B s L h^2 [(1 + g/a + s/h) q/h
    + (f/h) gated + V/(2 L h)], the s^2 term not causally halved."""
    h, s, L = model.hidden, model.seq_len, model.layers
    q = model.heads * model.head_dim_ / h
    gated = 1.5 if model.activation == "swiglu" else 1.0
    return 12 * gb * s * L * h * h * ((1 + model.kv_heads_ / model.heads + s / h) * q
                                      + model.ffn_hidden_ / h * gated + model.vocab / (2 * L * h))


def model_flops_palm(model: ModelSpec, gb: int) -> float:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12 L h s per token, N without embeddings."""
    h, s, L = model.hidden, model.seq_len, model.layers
    mats = 3 if model.activation == "swiglu" else 2
    n = L * (4 * h * h + mats * h * model.ffn_hidden_)
    return gb * s * (6 * n + 12 * L * h * s)


def step_time(row: dict, model: ModelSpec, gb: int, gpu: str) -> tuple[float, str]:
    meas, der = row["measured"], row.get("derived") or {}
    if isinstance(meas.get("iteration_time_s"), (int, float)):
        return float(meas["iteration_time_s"]), "measured"
    if isinstance(meas.get("iteration_time_ms"), (int, float)):
        return float(meas["iteration_time_ms"]) / 1e3, "measured"
    if isinstance(der.get("iteration_time_s"), (int, float)):
        return float(der["iteration_time_s"]), "derived by the data set from the source's FLOP convention"
    n = int(row["hardware"]["num_gpus"])
    if row["source"]["ref"] == "megatron_readme_h100" and meas.get("mfu_pct"):
        return model_flops_megatron(model, gb) / (n * meas["mfu_pct"] / 100 * PEAK[gpu]), "from MFU (Megatron-Core FLOPs)"
    if row["source"]["ref"] == "glm130b" and meas.get("mfu_pct"):
        return model_flops_palm(model, gb) / (n * meas["mfu_pct"] / 100 * PEAK[gpu]), "from MFU (PaLM FLOPs)"
    raise Excluded("no step time: throughput without a stated FLOP convention")



# ---- held-out rows (data/extra_runs.yaml) -------------------------------------------------------
def load_extra(path: Path = EXTRA, role: str = "held-out") -> tuple[list[Run], list[tuple[str, str]], dict]:
    """(predictable runs, [(id, why excluded)], the file's `sources` block) of the sources with `role`:
    held-out (the default: never fitted) or calibration (fitted on with the calibration set)."""
    data = yaml.safe_load(path.read_text())
    runs, excluded = [], []
    roles = {name: src.get("role", "held-out") for name, src in data.get("sources", {}).items()}
    for row in (r for r in data["runs"] if roles.get(r["source"]["ref"], "held-out") == role):
        try:
            runs.append(extra_to_run(row))
        except Excluded as why:
            excluded.append((row["id"], str(why)))
    return runs, excluded, data.get("sources", {})


def extra_to_run(row: dict, require_time: bool = True) -> Run:
    """The run of an extra_runs.yaml row (`require_time=False`: also without a step time, as `to_run`)."""
    if row.get("excluded"):
        raise Excluded(row["excluded"])
    par, batch, train = row["parallelism"], row["batch"], row["training"]
    gpu = extra_gpu_kind(row["hardware"]["gpu"])
    try:
        measured = extra_step_time(row)
    except Excluded as why:
        if require_time:
            raise
        measured = (float("nan"), str(why))
    model = extra_model(row)
    precision = str(train["precision"])
    training = TrainingSpec(global_batch=int(batch["global_batch_seqs"]), precision=precision)
    knobs, unknown = extra_knobs(par, batch, train)
    try:
        Layout(**knobs)
    except ValueError as err:
        raise Excluded(f"layout not expressible: {first_error(err)}") from None
    return Run(id=row["id"], source=row["source"]["ref"], engine=extra_engine(train), cluster=EXTRA_CLUSTERS[gpu],
               gpus=int(row["hardware"]["num_gpus"]), model=model, training=training, knobs=knobs, unknown=unknown,
               measured_s=measured[0], how_measured=measured[1], pair_of=row.get("pair_of"),
               vpp_choices=vpp_depths(model.layers, knobs["pp"]),
               measured_alt_s=(row.get("derived") or {}).get("iteration_time_s_other_count"),
               framework=str(train.get("framework") or ""), dispatcher=extra_dispatcher(train),
               ep_overlap=str(train.get("ep_overlap") or "none"), act_offload=str(train.get("act_offload") or "none"),
               measured_dropless_s=(row.get("derived") or {}).get("iteration_time_s_dropless"))


def extra_dispatcher(train: dict) -> str:
    """The token dispatcher a held-out row names (DeepEP, HybridEP; otherwise the all-to-all)."""
    text = str(train.get("dispatcher") or "").lower()
    return next((name for name in ("deepep", "hybridep") if name in text), "alltoall")


def extra_engine(train: dict) -> str:
    """The engine profile a held-out row is predicted with, by the software the source names."""
    framework = str(train.get("framework") or "").lower()
    return next((engine for word, engine in EXTRA_ENGINES if word in framework), "megatron-core")


def vpp_depths(layers: int, pp: int) -> tuple[int, ...]:
    """Interleaving depths Megatron-Core can run on an even split: the divisors of layers / pp
    (its MoE README: 'the legal values of vpp_size are all common divisors of num_layers/pp_size';
    Mixtral 8x22B's reference mapping uses 7)."""
    per_rank = layers // pp if layers % pp == 0 else 1
    return tuple(v for v in range(1, per_rank + 1) if per_rank % v == 0)


def first_error(err: ValueError) -> str:
    """The first message of a (pydantic) validation error, without its documentation link."""
    errors = getattr(err, "errors", None)
    if callable(errors) and errors():
        return str(errors()[0]["msg"]).removeprefix("Value error, ")
    return str(err).splitlines()[0]


def extra_gpu_kind(text: str) -> str:
    low = str(text).lower()
    for kind in EXTRA_CLUSTERS:
        if kind in low:
            return kind
    raise Excluded(f"GPU {text!r} has no bundled cluster spec")


def extra_step_time(row: dict) -> tuple[float, str]:
    meas, der = row["measured"], row.get("derived") or {}
    if isinstance(meas.get("iteration_time_s"), (int, float)):
        return float(meas["iteration_time_s"]), "measured"
    if isinstance(der.get("iteration_time_s"), (int, float)):
        return float(der["iteration_time_s"]), "derived by the data set (see the row's formula)"
    raise Excluded("no step time in the source or derivable from it")


def extra_model(row: dict) -> ModelSpec:
    """The row's model; a run that forced balanced routing (Megatron-Core
    --moe-router-force-load-balancing) states its expert load, 1.0 (`MoESpec.load_factor`)."""
    m = row["model"]
    fields = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "seq_len", "activation",
              "norm", "position", "bias", "qkv_bias", "tied_embeddings", "moe", "mla")
    values = {k: m[k] for k in fields if m.get(k) is not None}
    if "moe" in values and forced_balance(row.get("training") or {}):
        values["moe"] = dict(values["moe"], load_factor=1.0)
    return ModelSpec(name=row["id"], **values)


def forced_balance(train: dict) -> bool:
    """The run forced balanced routing (its measured step is the forced-balance one)."""
    return str(train.get("token_routing") or "").startswith("forced balance")


def extra_knobs(par: dict, batch: dict, train: dict) -> tuple[dict, tuple[str, ...]]:
    """Layout fields the row states, and the knobs left to resolve. Megatron-Core needs sequence
    parallelism with tp > 1 and experts (its MoE README); its distributed optimizer is ZeRO-1 and
    Megatron-FSDP is ZeRO-3."""
    zero = str(par.get("zero", "")).lower()
    knobs = {"tp": int(par["tp"]), "pp": int(par["pp"]), "dp": int(par["dp"]), "cp": int(par.get("cp") or 1),
             "ep": int(par.get("ep") or 1), "zero": 3 if ("fsdp" in zero or "zero-3" in zero) else 1,
             "sequence_parallel": int(par["tp"]) > 1}
    if knobs["dp"] * knobs["cp"] == 1:
        knobs["zero"] = 0
    if par.get("etp") is not None and int(par["etp"]) != knobs["tp"]:
        knobs["etp"] = int(par["etp"])  # MoE Parallel Folding: the experts' own tensor-parallel degree
    if par.get("pp_layers"):
        knobs["pp_layers"] = tuple(par["pp_layers"])
    schedule = str(par.get("pipeline_schedule") or "").lower()
    if schedule.startswith("dualpipe"):
        knobs["schedule"] = "dualpipev" if schedule.startswith("dualpipev") else "dualpipe"
    unknown = []
    for name, value in (("micro_batch", batch.get("micro_batch")), ("vpp", par.get("vpp"))):
        if isinstance(value, int):
            knobs[name] = value
        elif name == "micro_batch" or knobs["pp"] > 1:
            unknown.append(name)
    recompute = str(train.get("activation_recompute")).lower()  # "none" when null: not stated, resolved below
    if train.get("activation_recompute") is not None and recompute in ("full", "none", "selective"):
        knobs["recompute"] = recompute
    elif fine_grained_mode(recompute) is not None:
        knobs["recompute"] = fine_grained_mode(recompute)
    else:
        unknown.append("recompute")  # other fine-grained module lists (shared_expert, mla_up_proj, ...) have no plan3d name
    return knobs, tuple(unknown)
