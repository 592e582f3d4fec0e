"""Multi-node simulation, placement check, crash / hang handling, resume and reshard."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from runtime_helpers import STEPS, assert_same_losses, check_completed_run, make_plan, metrics, run, summary

pytestmark = pytest.mark.slow


def _survivors(marker: str) -> list[str]:
    """Processes whose command line mentions `marker` (the run directory)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def _two_launchers(plan, run_dir, env_for_node=lambda node: None, extra=()):
    from plan3d.run.launch import free_port

    port, results = free_port(), {}

    def node(rank):
        results[rank] = run(plan, run_dir, extra=extra, nnodes=2, node_rank=rank, master_port=port,
                            env=env_for_node(rank))

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_two_nodes_static_rendezvous_same_losses(reference, tmp_path):
    plan = make_plan(nodes=2, gpus_per_node=2, tp=2, pp=2)
    results = _two_launchers(plan, tmp_path, extra=["--no-save"])
    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items()}
    assert_same_losses(metrics(tmp_path), reference, range(1, STEPS + 1))
    assert [r["rank"] for r in summary(tmp_path)["ranks"]] == list(range(4))


def test_wrong_node_rank_is_caught_by_the_placement_check(tmp_path):
    plan = make_plan(nodes=2, gpus_per_node=1, dp=2)
    # node 1's scheduler says it is node 0 while torchrun is told --node-rank 1
    results = _two_launchers(plan, tmp_path, env_for_node=lambda node: {"PLAN3D_NODE_RANK": "0"})
    assert all(not r.ok for r in results.values())
    errors = " ".join(r.error or "" for r in results.values())
    assert "placement check failed" in errors and "rank 1 runs on node 0" in errors


def test_killed_rank_ends_job_then_a_reshard_reproduces_losses(reference, tmp_path):
    """A SIGKILLed rank ends the job at once (torchrun sees the exit) and is named; the run's
    checkpoint of step 2 (ZeRO-1, tp1 pp2 dp2) resumes into a new run directory under another
    layout (ZeRO-3, tp2 pp1 dp2), which inherits steps 1-2 and reproduces every loss. (A resume in
    place from `latest`, same layout, is test_crash_during_a_save_keeps_the_previous_checkpoint.)"""
    plan = make_plan(pp=2, dp=2, zero=1)
    first = tmp_path / "killed"
    start = time.monotonic()
    result = run(plan, first, extra=["--save-every", "2", "--fail-at-step", "3", "--fail-rank", "3"])
    assert not result.ok and result.exit_code != 0
    assert time.monotonic() - start < 30 + 25, "start-up (~20 s) plus the 30 s allowed to stop"
    assert result.failed_rank == 3 and "SIGKILL" in result.error, (result, (first / "logs" / "launcher0.log").read_text()[-1500:])
    assert not _survivors(str(first)), "orphan processes"
    assert (first / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not list((first / "checkpoints").glob("*.tmp"))
    assert_same_losses(metrics(first), reference, (1, 2, 3))

    reshard = tmp_path / "tp2-pp1-dp2"
    other = make_plan(tp=2, pp=1, dp=2, zero=3)
    resharded = run(other, reshard, extra=["--resume-from", str(first / "checkpoints" / "step_00000002"), "--no-save"])
    assert resharded.ok, resharded.error
    check_completed_run(other, reshard, reference)  # steps 1-2 inherited from `first`
    _check_whole_run(reshard, reference, [("tp1 pp2 dp2", 1, 2, "interrupted"), ("tp2 pp1 dp2", 3, 4, "completed")], 4)
    _check_report_shows_segments(reshard, "tp2 pp1 dp2")


def _check_whole_run(run_dir, reference, want: list[tuple[str, int, int, str]], world: int) -> None:
    """summary.json covers every step and every launch (segment): its steps, the step it resumed
    from, its layout and its own timing."""
    done = summary(run_dir)
    assert done["first_step"] == 1 and done["steps"] == STEPS
    assert_same_losses(dict(enumerate(done["losses"], 1)), reference, range(1, STEPS + 1))
    segments = done["segments"]
    assert len(segments) == len(want)
    for segment, (layout, first, last, ended) in zip(segments, want):
        assert segment["layout"].startswith(layout) and segment["world_size"] == world
        assert (segment["first_step"], segment["last_step"], segment["ended"]) == (first, last, ended)
        assert segment["resumed_at_step"] == first - 1 and (segment["resumed_from"] is None) == (first == 1)
        assert segment["step_time_s"] > 0 and segment["train_time_s"] > 0
        assert segment["plan_digest"] and "predicted_step_time_s" not in segment  # the runtime records, never predicts
    assert done["step_time_s"] == pytest.approx(segments[-1]["step_time_s"])  # the last launch's layout


def _check_report_shows_segments(run_dir, second_layout: str) -> None:
    from plan3d.run.compare import compare
    from plan3d.run.record import read_run

    report = compare(read_run(run_dir))
    assert [(s["first_step"], s["last_step"]) for s in report.segments] == [(1, 2), (3, STEPS)]
    first, second = (s["predicted_step_time_s"] for s in report.segments)  # each from the plan it ran
    assert first > 0 and second > 0 and first != pytest.approx(second)
    result = subprocess.run([sys.executable, "-m", "plan3d", "report", str(run_dir)], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert f"segment 2: steps 3..{STEPS} (resumed from step 2), {second_layout}" in result.stdout


def test_hung_rank_times_out_and_ends_the_job(tmp_path):
    plan = make_plan(dp=2)
    start = time.monotonic()
    result = run(plan, tmp_path, extra=["--fail-at-step", "2", "--fail-rank", "1", "--fail-mode", "hang",
                                        "--timeout-s", "4", "--no-save"])
    assert not result.ok
    assert time.monotonic() - start < 60
    assert result.failed_rank == 1 and "hung" in result.error and "timed out" in result.error.lower()
    assert not _survivors(str(tmp_path))


def test_a_stopped_rank_of_a_3d_layout_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    """SIGSTOP on rank 5 of tp2 pp2 dp2: its tp, pp and dp peers wait in groups the DeviceMesh
    made (pipeline p2p included), which must honour --timeout-s like the world group."""
    timeout_s = 5
    plan = make_plan(tp=2, pp=2, dp=2, zero=1)
    result = run(plan, tmp_path, extra=["--fail-at-step", "2", "--fail-rank", "5", "--fail-mode", "stop",
                                        "--timeout-s", str(timeout_s), "--no-save"])
    ended = time.time()
    hung_at = (tmp_path / "metrics.jsonl").stat().st_mtime  # step 2's record, just before the stop
    assert not result.ok
    assert result.failed_rank == 5 and "rank 5 hung" in result.error and "timed out" in result.error.lower(), result
    assert ended - hung_at < timeout_s + 15, f"the job ended {ended - hung_at:.0f} s after the hang"  # seen: 5.7 s
    assert not _survivors(str(tmp_path))


def test_ctrl_c_stops_every_rank_and_keeps_the_checkpoints(tmp_path):
    import signal
    import sys
    from pathlib import Path

    plan3d = Path(sys.executable).with_name("plan3d")
    proc = subprocess.Popen([str(plan3d), "launch", "--dp", "2", "--steps", "500", "--save-every", "1",
                             "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` in a script
    deadline = time.monotonic() + 90
    while not (tmp_path / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err and f"--resume --run-dir {tmp_path}" in err
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert not _survivors(str(tmp_path))
    latest = (tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text())
    assert (latest / "meta.json").exists()


def test_crash_during_a_save_keeps_the_previous_checkpoint(reference, tmp_path):
    plan = make_plan(dp=2, zero=2)
    result = run(plan, tmp_path, extra=["--save-every", "1", "--fail-at-step", "2", "--fail-rank", "1",
                                        "--fail-mode", "kill-during-save"])
    assert not result.ok and result.failed_rank == 1
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_00000001"
    assert (checkpoints / "step_00000002.tmp").exists() and not (checkpoints / "step_00000002").exists()
    resumed = run(plan, tmp_path, extra=["--resume-from", str(tmp_path), "--no-save"])  # in place, from `latest`
    assert resumed.ok, resumed.error
    assert not (checkpoints / "step_00000002.tmp").exists(), "the interrupted save is cleaned up"
    check_completed_run(plan, tmp_path, reference)  # ZeRO-2 on pure dp: losses, model-state bytes, groups, phases
    _check_whole_run(tmp_path, reference, [("tp1 pp1 dp2", 1, 1, "interrupted"), ("tp1 pp1 dp2", 2, 4, "completed")], 2)


def _damage_in_place(path) -> None:
    """Overwrite bytes in the middle of a file, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(16)
    path.write_bytes(bytes(data))


def test_non_finite_loss_stops_before_saving_and_damaged_checkpoints_are_refused(tmp_path, capsys):
    import json

    from plan3d.cli import main

    plan = make_plan(dp=2, zero=2)
    result = run(plan, tmp_path, steps=5, extra=["--save-every", "1", "--keep-last", "2", "--fail-at-step", "3",
                                                 "--fail-rank", "1", "--fail-mode", "nan"])
    assert not result.ok and "became nan at step 4" in result.error and "stopped before saving" in result.error
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000002", "step_00000003"]  # keep-last 2
    assert (checkpoints / "latest").read_text() == "step_00000003"

    shard = sorted((checkpoints / "step_00000003").glob("*.distcp"))[0]
    _damage_in_place(shard)
    refused = run(plan, tmp_path, extra=["--resume-from", str(tmp_path), "--no-save"])  # the ranks check too
    assert not refused.ok and "damaged" in refused.error and shard.name in refused.error
    with pytest.raises(SystemExit) as info:  # the CLI refuses before any rank starts
        main(["launch", "--dp", "2", "--zero", "2", "--steps", "5", "--resume", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert str(shard) in err and f"--resume-from {checkpoints / 'step_00000002'}" in err


def test_a_missing_node_and_a_duplicate_node_rank_are_bounded_and_named(tmp_path):
    from plan3d.errors import LaunchError
    from plan3d.run.launch import free_port, port_in_use

    plan, port, results = make_plan(nodes=2, gpus_per_node=1, dp=2), free_port(), {}
    node0 = threading.Thread(target=lambda: results.setdefault(0, run(
        plan, tmp_path, extra=["--timeout-s", "4"], nnodes=2, node_rank=0, master_port=port)))
    node0.start()
    deadline = time.monotonic() + 60
    while not port_in_use("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LaunchError, match=f"port {port} .* in use.*--node-rank 0"):
        run(plan, tmp_path / "second", nnodes=2, node_rank=0, master_port=port)
    node0.join(60)
    assert not node0.is_alive(), "node 0 waited past --timeout-s for the missing node"
    assert not results[0].ok and "only 1 of 2 nodes joined" in results[0].error


# A port taken before torchrun binds it: test_runtime_data.py (the same launch learns the bundled text).


def test_a_multi_node_plan_on_one_machine_runs_every_node_locally(reference, tmp_path):
    plan = make_plan(nodes=2, gpus_per_node=1, dp=2)
    result = run(plan, tmp_path, extra=["--no-save"])
    assert result.ok, result.error
    assert (tmp_path / "logs" / "launcher0.log").exists() and (tmp_path / "logs" / "launcher1.log").exists()
    check_completed_run(plan, tmp_path, reference)  # ZeRO-0 (replicated fp32) over dp2: model-state bytes too
