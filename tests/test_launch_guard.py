"""`plan3d launch` never overwrites a previous run by accident."""
import pytest

from plan3d.cli import main


def test_launch_into_a_run_directory_that_holds_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(SystemExit) as info:
        main(["launch", "--tp", "2", "--steps", "2", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "already holds a run" in err and "--resume" in err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched
    assert not (tmp_path / "logs").exists()  # nothing was started
