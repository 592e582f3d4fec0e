"""Run an emitted job script with bash, a stub `torchrun` (and `srun`, `scontrol`) on PATH that
record what they were started with: the script is tested by what it does, not by its text."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SENTINEL = "sentinel-from-the-environment"  # CUDA_DEVICE_MAX_CONNECTIONS before the script runs
REQUIRED_DEFAULTS = {"MEGATRON_LM": "/opt/Megatron-LM", "DATA_PATH": "mock", "TOKENIZER": "null",
                     "TRAIN_ITERS": "10", "LR": "0.0003", "MASTER_ADDR": "10.0.0.1", "TRAIN_STEPS": "10",
                     "TRAIN_SCRIPT": "/work/train.py", "HF_ASSETS": "/assets/hf/Llama-3.1-8B"}
RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$STUB_DIR/$(basename "$0").argv"
env -0 > "$STUB_DIR/$(basename "$0").env"
"""
SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$STUB_DIR/srun.argv"
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 "$@"
"""
SCONTROL = """#!/usr/bin/env bash
printf 'node-a\\nnode-b\\n'
"""


@dataclass
class ScriptRun:
    returncode: int
    stderr: str
    argv: list[str]  # torchrun's arguments
    env: dict[str, str]  # torchrun's environment
    run_dirs: list[str]  # what the script made under RUN_DIR, relative
    run_files: dict[str, str]  # the files it wrote there: relative path -> text
    srun_argv: list[str]

    def program_args(self, program: str = "pretrain_gpt.py") -> list[str]:
        """The arguments after the program torchrun starts (the first argument ending in `program`)."""
        at = next(i for i, a in enumerate(self.argv) if a.endswith(program))
        return self.argv[at + 1:]

    def torchrun_options(self, program: str = "pretrain_gpt.py") -> list[str]:
        at = next(i for i, a in enumerate(self.argv) if a.endswith(program))
        return self.argv[:at]


def required_variables(text: str) -> set[str]:
    return set(re.findall(r'\$\{([A-Z_]+):\?', text))


def run_script(text: str, env: dict[str, str] | None = None, args: list[str] = (), fill_required: bool = True,
               ) -> ScriptRun:
    """Execute `text` with bash; the required variables it names get REQUIRED_DEFAULTS unless
    `env` gives them or `fill_required` is False."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        stubs = tmp_path / "bin"
        stubs.mkdir()
        for name, body in (("torchrun", RECORDER), ("srun", SRUN), ("scontrol", SCONTROL)):
            (stubs / name).write_text(body)
            (stubs / name).chmod(0o755)
        script = tmp_path / "job.sh"
        script.write_text(text)
        base = {"PATH": f"{stubs}:{os.environ['PATH']}", "STUB_DIR": str(stubs), "HOME": tmp,
                "CUDA_DEVICE_MAX_CONNECTIONS": SENTINEL, "RUN_DIR": str(tmp_path / "run"),
                "SLURM_JOB_NODELIST": "node-[a-b]"}
        if fill_required:
            base |= {k: v for k, v in REQUIRED_DEFAULTS.items() if k in required_variables(text)}
        done = subprocess.run(["bash", str(script), *args], env=base | (env or {}), cwd=tmp,
                              capture_output=True, text=True, timeout=60)
        argv_file, env_file = stubs / "torchrun.argv", stubs / "torchrun.env"
        argv = argv_file.read_text().split("\0")[:-1] if argv_file.exists() else []
        environ = dict(item.split("=", 1) for item in env_file.read_text().split("\0")[:-1]) \
            if env_file.exists() else {}
        srun = stubs / "srun.argv"
        srun_argv = srun.read_text().split("\0")[:-1] if srun.exists() else []
        made = sorted(str(p.relative_to(tmp_path / "run")) for p in (tmp_path / "run").rglob("*")) \
            if (tmp_path / "run").exists() else []
        run_dir = tmp_path / "run"
        written = {name: (run_dir / name).read_text() for name in made if (run_dir / name).is_file()}
        return ScriptRun(done.returncode, done.stderr, argv, environ, made, written, srun_argv)


def flags(tokens: list[str]) -> dict[str, str | bool]:
    """Flags to values (True for switches); a later flag wins, as argparse does."""
    out, i = {}, 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[tokens[i]], i = tokens[i + 1], i + 2
        else:
            out[tokens[i]], i = True, i + 1
    return out
