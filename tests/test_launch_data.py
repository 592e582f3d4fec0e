"""`--data` for `plan3d launch` and `emit torchrun|slurm`: a token file is checked before any rank
starts (bad input: exit 2, one line), resolved to an absolute path for the ranks, and passed
through by the emitters. No ranks run here."""
from __future__ import annotations

import shlex

import numpy as np
import pytest

from plan3d.cli import main
from plan3d.plan import save_plan
from plan3d.run.tokens import BUNDLED, write_tokens


def _run(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def _bad_file(tmp_path, kind: str) -> str:
    """A token file tiny-gpt (vocab 256, sequence 32) cannot train on."""
    path = tmp_path / f"{kind}.bin"
    if kind == "outside-vocab":
        write_tokens(path, np.arange(1000) % 300)
    elif kind == "too-short":
        write_tokens(path, [1, 2, 3])
    elif kind == "odd-size":
        path.write_bytes(b"\x01\x00\x02")
    elif kind == "directory":
        path.mkdir()
    elif kind == "bad-megatron-index":
        write_tokens(path, np.arange(1000) % 200)
        path.with_suffix(".idx").write_bytes(b"not an index")
    return str(path)


@pytest.mark.parametrize("kind, needle", [
    ("missing", "no such token file or bundled corpus (python-docs)"),
    ("directory", "no such token file"),
    ("outside-vocab", "outside the model's vocabulary 0..255"),
    ("too-short", "needs at least 33 tokens"),
    ("odd-size", "not a whole number of uint16 tokens"),
    ("bad-megatron-index", "not a Megatron indexed-dataset index"),
])
def test_launch_refuses_a_bad_token_file_before_any_rank_starts(tmp_path, capsys, kind, needle):
    data = str(tmp_path / "nope.bin") if kind == "missing" else _bad_file(tmp_path, kind)
    run_dir = tmp_path / "run"
    code, _, err = _run(capsys, "launch", "--tp", "2", "--steps", "2", "--run-dir", str(run_dir), "--data", data)
    assert code == 2 and needle in err and f"--data {data}" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not run_dir.exists()


def test_dry_run_gives_the_ranks_the_absolute_path_of_a_relative_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "corpus.bin", np.arange(4000) % 256)
    code, out, _ = _run(capsys, "launch", "--dp", "2", "--steps", "2", "--run-dir", "r", "--data", "corpus.bin", "--dry-run")
    assert code == 0
    argv = shlex.split([line for line in out.splitlines() if not line.startswith("#")][0])
    assert argv[argv.index("--data") + 1] == str(tmp_path / "corpus.bin")


def test_dry_run_resolves_a_bundled_corpus_name(tmp_path, capsys):
    code, out, _ = _run(capsys, "launch", "--steps", "2", "--run-dir", str(tmp_path / "r"), "--data", "python-docs",
                        "--dry-run")
    assert code == 0 and f"--data {BUNDLED / 'python-docs.bin'}" in out


@pytest.fixture
def plan_file(tmp_path):
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("local-cpu", "tiny-gpt", None, None, None, None, "fp32")
    path = tmp_path / "plan.json"
    save_plan(build_plan(cluster, model, training, make_layout(tp=2, dp=2), {}), path)
    return str(path)


def test_emit_torchrun_passes_data_to_every_worker(capsys, plan_file):
    code, out, err = _run(capsys, "emit", "torchrun", plan_file, "--data", "python-docs")
    assert code == 0 and not err
    for line in (line for line in out.splitlines() if not line.startswith("#")):
        argv = shlex.split(line)
        assert argv[argv.index("--data") + 1] == "python-docs"  # the worker resolves the bundled name on the node


def test_emit_slurm_passes_data_to_every_launcher_and_notes_a_file_not_here(capsys, plan_file):
    code, out, err = _run(capsys, "emit", "slurm", plan_file, "--data", "$DATA/corpus.bin")
    assert code == 0 and '--data "$DATA/corpus.bin"' in out
    assert err.startswith("note: --data $DATA/corpus.bin is not on this machine")


@pytest.mark.parametrize("command", ["torchrun", "slurm"])
def test_emit_refuses_a_bad_token_file_it_can_read(tmp_path, capsys, plan_file, command):
    data = _bad_file(tmp_path, "outside-vocab")
    code, out, err = _run(capsys, "emit", command, plan_file, "--data", data)
    assert code == 2 and not out and "outside the model's vocabulary" in err and len(err.strip().splitlines()) == 1


def test_emit_refuses_shell_syntax_in_data(capsys, plan_file):
    code, _, err = _run(capsys, "emit", "slurm", plan_file, "--data", "x$(reboot).bin")
    assert code == 2 and "--data may use $NAME" in err
