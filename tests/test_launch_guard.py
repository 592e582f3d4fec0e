"""`plan3d launch` never overwrites a previous run by accident, and checks what it is given
(flags, the checkpoint to resume, the disk) before any rank starts. No ranks run here."""
import json

import pytest

from plan3d.cli import main


def test_launch_into_a_run_directory_that_holds_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(SystemExit) as info:
        main(["launch", "--tp", "2", "--steps", "2", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched
    assert not (tmp_path / "logs").exists()  # nothing was started


def _launch(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(["launch", *args])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--timeout-s", "inf"], "--timeout-s must be a finite number"),
    (["--timeout-s", "nan"], "--timeout-s must be a finite number"),
    (["--master-port", "1" * 31], "--master-port must be a port"),
    (["--keep-last", "-1"], "--keep-last must be"),
    (["--master-addr", "node0\nnode1"], "--master-addr must be"),
])
def test_launch_refuses_nonsense_flags_before_anything_starts(tmp_path, capsys, flags, needle):
    code, err = _launch(capsys, "--tp", "2", "--run-dir", str(tmp_path / "r"), *flags)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_resume_without_a_checkpoint_is_refused_before_any_rank_starts_and_says_how_to_start_afresh(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # interrupted before its first save
    code, err = _launch(capsys, "--tp", "2", "--resume", "--run-dir", str(tmp_path))
    assert code == 2 and "no complete checkpoint" in err and "--overwrite" in err
    assert not (tmp_path / "logs").exists()
    code, err = _launch(capsys, "--tp", "2", "--resume", "--overwrite", "--run-dir", str(tmp_path))
    assert code == 2 and "only one" in err


def test_the_advice_after_an_interrupt_is_what_will_work(tmp_path):
    from plan3d.cli.launch_cmd import interrupt_advice

    assert "--overwrite" in interrupt_advice(tmp_path) and "--resume" not in interrupt_advice(tmp_path)
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 2}')
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002")
    assert "step_00000002" in interrupt_advice(tmp_path) and f"--resume --run-dir {tmp_path}" in interrupt_advice(tmp_path)


def test_overwrite_clears_the_previous_run_and_nothing_else(tmp_path):
    from plan3d.cli.launch_cmd import _clear_previous_run

    for name in ("metrics.jsonl", "summary.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "0123abcd.json").write_text("{}")
    _clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _checkpoint(root, step: int, shards: dict[str, bytes], checksums: bool = True):
    from plan3d.run.checkpoints import shard_checksums

    directory = root / f"step_{step:08d}"
    directory.mkdir(parents=True)
    for name, data in shards.items():
        (directory / name).write_bytes(data)
    meta = {"step": step, **({"checksums": shard_checksums(directory, shards)} if checksums else {})}
    (directory / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text(directory.name)
    return directory


@pytest.mark.parametrize("harm", ["overwrite", "truncate", "delete"])
def test_a_damaged_shard_is_refused_naming_the_file_and_the_previous_good_checkpoint(tmp_path, harm):
    from plan3d.run.checkpoints import CheckpointError, verified

    root = tmp_path / "checkpoints"
    good = _checkpoint(root, 2, {"__0_0.distcp": b"a" * 64, ".metadata": b"m"})
    newest = _checkpoint(root, 4, {"__0_0.distcp": b"b" * 64, "__1_0.distcp": b"c" * 64, ".metadata": b"m"})
    shard = newest / "__1_0.distcp"
    {"overwrite": lambda: shard.write_bytes(b"c" * 32 + b"X" + b"c" * 31), "truncate": lambda: shard.write_bytes(b"c"),
     "delete": shard.unlink}[harm]()
    with pytest.raises(CheckpointError) as info:
        verified(tmp_path)
    message = str(info.value)
    assert str(shard) in message and f"--resume-from {good}" in message and "\n" not in message
    assert info.value.exit_code == 2


def test_checkpoints_without_checksums_load_and_keep_last_prunes_the_oldest(tmp_path):
    from plan3d.run.checkpoints import complete_checkpoints, prune, verified

    root = tmp_path / "checkpoints"
    made = [_checkpoint(root, step, {"__0_0.distcp": bytes([step])}, checksums=step > 1) for step in (1, 2, 3, 4)]
    assert verified(made[0]) == made[0]  # written before checksums existed
    assert prune(root, 0, protect=made[-1]) == []
    assert prune(root, 2, protect=made[-1]) == made[:2]
    assert complete_checkpoints(root) == made[2:]


def test_a_full_disk_is_diagnosed_from_the_launcher(tmp_path, monkeypatch):
    import shutil

    from plan3d.errors import LaunchError
    from plan3d.run.launch import check_free_space, diagnose

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1024))
    with pytest.raises(LaunchError, match="no space left on the disk holding"):
        check_free_space(tmp_path)
    rank, message = diagnose(tmp_path, "", 8)
    assert rank is None and "no space left" in message and "--run-dir" in message


def test_a_layout_that_does_not_fit_in_memory_is_refused_before_any_rank_starts(tmp_path, capsys):
    """llama3-8b on 8 CPU processes of 2 GiB: ~196 GiB per rank predicted; a dry run is refused too."""
    for dry in (["--dry-run"], []):
        code, err = _launch(capsys, "-c", "local-cpu", "-m", "llama3-8b", "--dp", "8", "--run-dir", str(tmp_path / "r"),
                            *dry)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert "does not fit" in err and "GiB" in err and "--allow-oversubscribe" in err
        assert not (tmp_path / "r").exists()


def test_allow_oversubscribe_starts_it_anyway(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "-c", "local-cpu", "-m", "llama3-8b", "--dp", "8", "--dry-run", "--allow-oversubscribe",
              "--run-dir", str(tmp_path / "r")])
    assert (info.value.code or 0) == 0 and "torch.distributed.run" in capsys.readouterr().out


def test_the_memory_check_reads_the_plans_estimate_or_the_cost_model(tmp_path):
    from plan3d.cli.launch_cmd import _plan_from_flags
    from plan3d.run.launch import memory_problem

    flags = dict(tp=2, pp=2, dp=2, micro_batch=1, vpp=1, zero=0, recompute="none", sequence_parallel=False,
                 order="tp-cp-ep-dp-pp")
    demo = _plan_from_flags("local-cpu", "tiny-gpt", None, None, None, None, None, flags)
    assert memory_problem(demo) is None  # the demos fit
    assert memory_problem(demo.model_copy(update={"estimate": None})) is None  # no estimate: the cost model's
    big = _plan_from_flags("local-cpu", "llama3-8b", None, None, None, None, None, flags)
    assert "does not fit" in memory_problem(big)
    assert "does not fit" in memory_problem(big.model_copy(update={"estimate": None}))


def test_a_fifo_where_the_run_plan_goes_is_refused_not_read(tmp_path):
    import os

    from plan3d.errors import Plan3dError
    from plan3d.run.launch import _write_once

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    with pytest.raises(Plan3dError):
        _write_once(fifo, "{}")
    assert fifo.is_fifo()


@pytest.mark.parametrize("recompute", ["partial", "moe-act"])
def test_launch_refuses_a_recompute_mode_the_runtime_profile_lacks(tmp_path, capsys, recompute):
    """What the bundled runtime runs is its profile (engine_specs/plan3d-runtime.yaml: none,
    selective, full recompute), read by the same evaluator as every engine's: a Megatron-Core plan
    with another mode is refused before any rank starts, naming the modes it has."""
    from plan3d.layout import Layout
    from plan3d.plan import build_plan, save_plan
    from plan3d.specs.catalog import load_cluster, load_engine, load_model
    from plan3d.specs.model import MoESpec
    from plan3d.specs.training import TrainingSpec

    model = load_model("tiny-gpt")
    if recompute == "moe-act":
        model = model.model_copy(update={"moe": MoESpec(experts=4, top_k=2)})
    plan = build_plan(load_cluster("local-cpu"), model, TrainingSpec(global_batch=8, precision="fp32"),
                      Layout(tp=1, pp=2, dp=2, recompute=recompute), engine=load_engine("megatron-core"))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    code, err = _launch(capsys, str(path), "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert code == 1 and f"plan3d-runtime has no {recompute} recompute; use one of none, selective, full" in err
    assert not (tmp_path / "run" / "logs").exists()
