"""`plan3d estimate` through the real entry point."""
import json

import pytest

from plan3d.cli import main
from cli_helpers import run_cli  # noqa: E402


def run(capsys, *args):
    return run_cli(capsys, "estimate", *args)


def run_ok(capsys, *args):
    try:
        main(["estimate", *args])
    except SystemExit as err:
        assert err.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def test_json_has_stable_keys(capsys):
    out = json.loads(run_ok(capsys, "-c", "dgx-a100-80g", "-m", "gpt3-175b", "--tp", "8", "--pp", "8",
                            "--recompute", "full", "--json"))
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes", "fits",
                "memory_bytes", "time_s", "tiers"):
        assert key in out
    assert out["layout"]["dp"] == 8  # filled the 512-GPU cluster


def test_table_shows_breakdown(capsys):
    out = run_ok(capsys, "-c", "dgx-h100", "-m", "llama3-8b", "--tp", "2", "--pp", "2", "--dp", "2",
                 "--micro-batch", "1", "--global-batch", "64", "--seq-len", "4096", "--vpp", "2", "--zero", "1",
                 "--sequence-parallel", "--order", "tp-cp-ep-pp-dp", "--nodes", "1", "--gpus-per-node", "8")
    for text in ("optimizer states", "activations", "pipeline bubble", "step", "MFU", "fits"):
        assert text in out


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "5"], "valid tp"),
    (["--tp", "8", "--pp", "192", "--dp", "1"], "valid pp"),
    (["--tp", "8", "--pp", "8", "--dp", "8", "--micro-batch", "5"], "valid"),
    (["--tp", "8", "--pp", "8", "--dp", "8", "--micro-batch", "64"], "1F1B needs at least"),
    (["--tp", "8", "--pp", "8", "--dp", "16"], "exceeds"),
    (["--tp", "3", "--pp", "1"], "divide"),
    (["--recompute", "some"], "recompute"),
])
def test_bad_layouts_exit_2_with_valid_choices(capsys, flags, needle):
    code, _, err = run(capsys, "-c", "dgx-a100-80g", "-m", "gpt3-175b", *flags)
    assert code == 2
    assert needle in err and "Traceback" not in err
