"""`plan3d emit` end to end: files written, inexpressible plans exit 1."""
from __future__ import annotations

from emit_helpers import make_plan, parse_megatron, run_cli
from plan3d.plan import save_plan


def test_cli_emit_writes_file_and_exits_1_when_inexpressible(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=1), path)
    assert run_cli(["emit", "deepspeed", str(path)]) == 1
    assert "error:" in capsys.readouterr().err
    assert run_cli(["emit", "megatron", str(path)]) == 0
    assert parse_megatron(capsys.readouterr().out)["--tensor-model-parallel-size"] == "8"
    save_plan(make_plan(tp=8, pp=2, dp=2, zero=3), path)
    out = tmp_path / "titan_job.py"
    assert run_cli(["emit", "torchtitan", str(path), "-o", str(out)]) == 0
    text = out.read_text()
    assert "data_parallel_shard_degree=2," in text and "--module titan_job --config plan3d_job" in text
