"""Engine job scripts: one bash script per node (`exec torchrun ...`) or one sbatch script (srun,
one launcher per node), around an engine's program and its arguments.

The script is what a user runs, not a fragment: a header naming the engine, the plan (digest,
layout, nodes x GPUs) and what was predicted for it; `set -euo pipefail`; the settings a run
needs and the plan does not hold as shell variables, each either given to `emit` (a default the
environment can override) or required (`${NAME:?what to set}`: bash stops with that one line
before anything starts); the engine's environment and the NCCL settings of the network
(`plan3d.emit.nccl_env`); the run directory (checkpoints, per-node torchrun logs with every
rank's output, tensorboard); the arguments as one bash array; and the launcher.

torchrun runs with the static rendezvous (`--rdzv-backend static --node-rank N`), so global
rank = node_rank x nproc_per_node + local rank: the placement the plan's rank map assumes
(plan3d.emit.torchrun). `--max-restarts 0`: a crashed rank ends the job with its exit code
instead of restarting the whole node group from a checkpoint the user may not have. Arguments
after the script's name ("$@") go to the engine's program last, so a user can add or override
a flag (argparse keeps the last value) without editing the script.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from plan3d.emit.nccl_env import nccl_lines
from plan3d.plan import Plan
from plan3d.render.units import gib

_SAFE_MESSAGE = re.compile(r"^[^$`'\"\\}]*$")  # text a ${NAME:?message} can hold literally


@dataclass(frozen=True)
class ScriptVariable:
    """A shell variable of the script: `default` given to emit (the environment can override it),
    else required, with `required` saying what to set."""

    name: str
    required: str
    default: str | None = None
    expand: bool = False  # the default is a shell expression ("$TRAIN_ITERS"), not a literal

    def lines(self) -> list[str]:
        if self.default is None:
            assert _SAFE_MESSAGE.match(self.required), self.required
            return [f'{self.name}="${{{self.name}:?{self.required}}}"']
        if self.expand or shlex.quote(self.default) == self.default:
            return [f'{self.name}="${{{self.name}:-{self.default}}}"']
        return [f'if [[ -z "${{{self.name}:-}}" ]]; then {self.name}={shlex.quote(self.default)}; fi']


@dataclass
class JobScript:
    """The engine-specific parts of a job script."""

    engine: str  # "megatron-core 0.17-0.19"
    program: list[str]  # what torchrun runs, shell words ('"$MEGATRON_LM/pretrain_gpt.py"' or '-m', 'mod')
    args: list[str]  # the plan's arguments, literal
    variables: list[ScriptVariable] = field(default_factory=list)
    environment: list[str] = field(default_factory=list)  # shell lines (export/unset with comments)
    run_lines: list[str] = field(default_factory=list)  # lines that append run settings to ARGS
    run_dirs: tuple[str, ...] = ("checkpoints", "logs", "tensorboard")
    files: list[tuple[str, str]] = field(default_factory=list)  # (path under RUN_DIR, text) the script writes


def _file_lines(path: str, text: str) -> list[str]:
    """A quoted here-document writing `text` to $RUN_DIR/path (nothing in it expands), through a
    file of this host and process renamed into place: nodes sharing RUN_DIR never read a half-written
    file (rename is atomic)."""
    delimiter = "PLAN3D_FILE_END"
    assert delimiter not in text and text.endswith("\n")
    tmp = f'"$RUN_DIR/{path}.tmp.$HOSTNAME.$$"'
    return [f"cat > {tmp} <<'{delimiter}'", *text[:-1].split("\n"), delimiter, f'mv -f {tmp} "$RUN_DIR/{path}"']


def nodes_of(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) the plan's world runs on."""
    world = plan.layout.world_size
    per_node = min(world, plan.gpus_per_node)
    return -(-world // per_node), per_node


def predicted_line(plan: Plan) -> str:
    """The prediction the plan carries, with the engine it is for."""
    est = plan.estimate
    if est is None:
        return "# predicted: nothing (the plan carries no estimate)"
    for_engine = plan.engine.name if plan.engine is not None else "no engine profile"
    mfu = f", MFU {est.mfu:.1%}" if est.mfu is not None else ""
    return (f"# predicted for {for_engine}: step {est.step_time_s:.3g} s, peak {gib(est.peak_memory_bytes)} "
            f"per GPU{mfu}")


def _header(plan: Plan, job: JobScript, nnodes: int, per_node: int, how: str) -> list[str]:
    return [f"# plan3d: {job.engine} job for plan {plan.digest}: {plan.model.name} {plan.layout.short()}",
            f"# {nnodes} node(s) x {per_node} GPUs = world {plan.layout.world_size}; {how}",
            predicted_line(plan),
            "# Arguments after the script's name go to the engine last (they override its flags)."]


def _settings(plan: Plan, job: JobScript, nnodes: int, node_rank: str) -> list[str]:
    lines = [line for var in job.variables for line in var.lines()]
    lines += [f'RUN_DIR="${{RUN_DIR:-runs/{plan.digest}}}"', f"NNODES={nnodes}"]
    if node_rank:
        lines.append(f'NODE_RANK="${{NODE_RANK:-{node_rank}}}"')
    if nnodes > 1 and node_rank:
        lines.append('MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (every node the same)}"')
    elif node_rank:
        lines.append('MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"')
    lines.append('MASTER_PORT="${MASTER_PORT:-29500}"')
    return lines


def _body(plan: Plan, job: JobScript, nnodes: int) -> list[str]:
    dirs = " ".join(f'"$RUN_DIR/{d}"' for d in job.run_dirs)
    files = [line for path, text in job.files for line in _file_lines(path, text)]
    return [*job.environment, *nccl_lines(plan, nnodes), f"mkdir -p {dirs}", *files, "",
            "ARGS=(", *_array_lines(job.args), ")", *job.run_lines]


def _torchrun_options(per_node: int) -> list[str]:
    return ['--nnodes "$NNODES"', f"--nproc-per-node {per_node}", "--rdzv-backend static",
            '--master-addr "$MASTER_ADDR"', '--master-port "$MASTER_PORT"', "--max-restarts 0", "--tee 3"]


def node_script(plan: Plan, job: JobScript) -> str:
    """The script to run once on every node (NODE_RANK 0..N-1; SLURM_NODEID when under srun)."""
    nnodes, per_node = nodes_of(plan)
    launch = ["exec torchrun", '--node-rank "$NODE_RANK"', '--log-dir "$RUN_DIR/logs/node$NODE_RANK"',
              *_torchrun_options(per_node), *job.program, '"${ARGS[@]}"', '"$@"']
    how = "run this script on every node (NODE_RANK 0, 1, ...)" if nnodes > 1 else "run this script on the node"
    return "\n".join(["#!/usr/bin/env bash", *_header(plan, job, nnodes, per_node, how), "set -euo pipefail", "",
                      *_settings(plan, job, nnodes, "${SLURM_NODEID:-0}"), "", *_body(plan, job, nnodes), "",
                      " \\\n  ".join(launch)]) + "\n"


def sbatch_body(plan: Plan, job: JobScript, srun_cpus: str) -> tuple[list[str], list[str]]:
    """(header comments, the lines after `set -euo pipefail` and the master address): srun starts
    one torchrun per node, each with its SLURM_NODEID as node rank, on `srun_cpus` cores."""
    nnodes, per_node = nodes_of(plan)
    inner = 'exec torchrun --node-rank "$SLURM_NODEID" --log-dir "$0/logs/node$SLURM_NODEID" "$@"'
    srun = f"srun --ntasks={nnodes} --ntasks-per-node=1 --cpus-per-task={srun_cpus} --kill-on-bad-exit=1"
    launch = [f"{srun} bash -c {shlex.quote(inner)}", '"$RUN_DIR"', *_torchrun_options(per_node), *job.program,
              '"${ARGS[@]}"', '"$@"']
    body = [*_settings(plan, job, nnodes, ""), "", *_body(plan, job, nnodes), "",
            "# single quotes on purpose: SLURM_NODEID expands in each node's bash ($0 is the run directory)",
            "# shellcheck disable=SC2016", " \\\n  ".join(launch)]
    return _header(plan, job, nnodes, per_node, "submit this script with sbatch from a directory every node sees"), body


def _array_lines(args: list[str]) -> list[str]:
    """Array elements, one flag and its values per line (a list-valued flag such as
    `--recompute-modules moe_act layernorm` keeps all its values on its line)."""
    lines, i = [], 0
    while i < len(args):
        end = i + 1
        while end < len(args) and not args[end].startswith("--"):
            end += 1
        lines.append("  " + " ".join(shlex.quote(a) for a in args[i:end]))
        i = end
    return lines
