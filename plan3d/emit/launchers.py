"""Which job a torchrun / sbatch script starts for each engine profile, as data, and the job
scripts of torchtitan and DeepSpeed (Megatron-Core's: plan3d.emit.megatron.megatron_job).

`LAUNCHER_OF` maps an engine profile to the launcher family that starts it: `megatron`
(Megatron-LM's pretrain_gpt.py; megatron-lm-2021 plans are re-estimated under megatron-core, as
`emit megatron` does), `torchtitan` (`-m torchtitan.train` on the job module, which the script
writes into `$RUN_DIR/job/`), `deepspeed` (the user's DeepSpeed training script, `TRAIN_SCRIPT`,
with `--deepspeed --deepspeed_config $RUN_DIR/ds_config.json`, the config the script writes) and
`runtime` (plan3d's bundled runtime, `plan3d launch`). Profiles without a launcher here
(megatron-deepspeed: Megatron-DeepSpeed's own trainer) fall back to the runtime with a note.

Each job script writes the engine's config next to its checkpoints and logs, so one file is the
whole job: what ran is what is in the run directory.
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.emit.deepspeed import VERSIONS as DEEPSPEED_VERSIONS
from plan3d.emit.deepspeed import emit_deepspeed
from plan3d.emit.launch_script import JobScript, ScriptVariable
from plan3d.emit.megatron import MegatronRun, megatron_job
from plan3d.emit.torchtitan import CONFIG_FUNCTION, DEFAULT_MODULE, emit_torchtitan
from plan3d.emit.torchtitan import VERSIONS as TORCHTITAN_VERSIONS
from plan3d.errors import SpecError
from plan3d.plan import Plan

LAUNCHER_OF = {"megatron-core": "megatron", "megatron-lm-2021": "megatron", "torchtitan": "torchtitan",
               "torchtitan-compile": "torchtitan", "deepspeed-0.19": "deepspeed", "deepspeed": "deepspeed",
               "plan3d-runtime": "runtime"}
EMIT_COMMAND = {"megatron": "plan3d emit megatron", "torchtitan": "plan3d emit torchtitan",
                "deepspeed": "plan3d emit deepspeed", "runtime": "plan3d launch"}
FALLBACK_EMITTER = {"megatron-deepspeed": "plan3d emit deepspeed (its ds_config.json)"}


@dataclass(frozen=True)
class Choice:
    engine: str  # the engine profile the script starts
    launcher: str  # LAUNCHER_OF[engine]
    note: str | None  # said when the plan was predicted for another engine


def choose_engine(plan: Plan, engine: str | None) -> Choice:
    """The engine a torchrun/sbatch script starts: `engine`, else the plan's where it has a launcher,
    else plan3d's runtime; SpecError for an engine no script here can start."""
    if engine is not None and engine not in LAUNCHER_OF:
        raise SpecError("--engine", [f"{engine!r} cannot be started by a job script; give one of "
                                     f"{', '.join(LAUNCHER_OF)}"
                                     + (f" (for {engine}: {FALLBACK_EMITTER[engine]})" if engine in FALLBACK_EMITTER
                                        else "")])
    planned = plan.engine.name if plan.engine is not None else None
    chosen = engine or (planned if planned in LAUNCHER_OF else "plan3d-runtime")
    note = None
    if planned is not None and LAUNCHER_OF.get(planned) != LAUNCHER_OF[chosen]:
        how = EMIT_COMMAND.get(LAUNCHER_OF.get(planned, ""), FALLBACK_EMITTER.get(planned, "its own trainer"))
        note = (f"the plan's predictions are for {planned}; this script starts {chosen}, which runs the layout at "
                f"another speed and memory (for {planned} itself: {how}, or `--engine {planned}`"
                f"{'' if planned in LAUNCHER_OF else ' where listed'})")
    return Choice(chosen, LAUNCHER_OF[chosen], note)


def torchtitan_job(plan: Plan, engine: str, train_steps: int | None,
                   hf_assets: str | None = None) -> tuple[JobScript, list[str]]:
    """`torchrun -m torchtitan.train --module plan3d_job --config plan3d_job`, the module written into
    $RUN_DIR/job and put on PYTHONPATH; torchtitan's dump folder (checkpoints, tensorboard) is RUN_DIR
    and its tokenizer the Hugging Face assets folder HF_ASSETS (`--hf_assets_path`; `emit --tokenizer`
    gives it a default). The data set is the recipe's (override after the script's name)."""
    emitted = emit_torchtitan(plan, compile=engine == "torchtitan-compile", module=DEFAULT_MODULE)
    steps = ScriptVariable("TRAIN_STEPS", "set TRAIN_STEPS to the number of training steps",
                           None if train_steps is None else str(train_steps))
    assets = ScriptVariable("HF_ASSETS", "set HF_ASSETS to the folder of the model tokenizer files from Hugging "
                            "Face (tokenizer.json)", hf_assets)
    job = JobScript(engine=f"{engine} {TORCHTITAN_VERSIONS}", program=["-m", "torchtitan.train"],
                    args=["--module", DEFAULT_MODULE, "--config", CONFIG_FUNCTION], variables=[steps, assets],
                    environment=['export PYTHONPATH="$RUN_DIR/job${PYTHONPATH:+:$PYTHONPATH}"  # the job module'],
                    run_lines=['ARGS+=(--dump_folder "$RUN_DIR" --training.steps "$TRAIN_STEPS" --hf_assets_path "$HF_ASSETS")'],
                    run_dirs=("job", "logs"), files=[(f"job/{DEFAULT_MODULE}.py", emitted.text)])
    return job, emitted.notes


def deepspeed_job(plan: Plan) -> tuple[JobScript, list[str]]:
    """torchrun around the user's DeepSpeed training script (`TRAIN_SCRIPT`: it calls
    deepspeed.initialize and takes DeepSpeed's --deepspeed / --deepspeed_config arguments), with
    the plan's ds_config.json written into $RUN_DIR."""
    emitted = emit_deepspeed(plan)
    script = ScriptVariable("TRAIN_SCRIPT", "set TRAIN_SCRIPT to your DeepSpeed training script (it calls "
                            "deepspeed.initialize and takes --deepspeed --deepspeed_config)")
    job = JobScript(engine=f"deepspeed {DEEPSPEED_VERSIONS}", program=['"$TRAIN_SCRIPT"'], args=[],
                    variables=[script], run_lines=['ARGS+=(--deepspeed --deepspeed_config "$RUN_DIR/ds_config.json")'],
                    run_dirs=("logs",), files=[("ds_config.json", emitted.text)])
    return job, emitted.notes


def engine_job(plan: Plan, choice: Choice, run: MegatronRun) -> tuple[JobScript, list[str]]:
    """The job script parts for a chosen engine other than the runtime."""
    if choice.launcher == "megatron":
        return megatron_job(plan, run)
    if choice.launcher == "torchtitan":
        hf_assets = run.tokenizer if run.tokenizer not in (None, "null") else None
        return torchtitan_job(plan, choice.engine, run.train_iters, hf_assets)
    return deepspeed_job(plan)
