"""Bad spec input, as a new user would type it: exit 2, one clear `error:` line per problem, no traceback."""
from __future__ import annotations

import time

import pytest
import yaml

from plan3d.layout import Layout, divisors, layout_problems
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec
from cli_helpers import run_cli  # noqa: E402

CLUSTER = {
    "name": "mine", "nodes": 4, "gpus_per_node": 8, "gpu": "h100-sxm",
    "network": [{"name": "nvlink", "bandwidth": {"gbytes_per_s_per_gpu": 450}, "latency_us": 3},
                {"name": "ib", "bandwidth": {"gbit_per_s_per_nic": 400, "nics_per_node": 8}, "latency_us": 8}],
    "source": "test",
}
MODEL = {"name": "mine", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 32000,
         "seq_len": 4096, "activation": "swiglu"}


def run(capsys, *args: str) -> tuple[int, list[str]]:
    code, _, err = run_cli(capsys, *args)
    assert "Traceback" not in err and "internal error" not in err, err
    return code, err.strip().splitlines()


def show(capsys, tmp_path, kind: str, data=None, text: str | None = None) -> tuple[int, list[str]]:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(data))
    return run(capsys, "specs", "show", str(path), "--kind", kind)


def with_changes(base: dict, **changes) -> dict:
    data = {**base, **changes}
    return {k: v for k, v in data.items() if v is not None}


def assert_problems(code: int, lines: list[str], *fragments: str) -> None:
    """Exit 2 and one `error:` line per expected problem, in any order."""
    assert code == 2, lines
    assert len(lines) == len(fragments), lines
    assert all(line.startswith("error: ") for line in lines), lines
    for fragment in fragments:
        assert any(fragment in line for line in lines), (fragment, lines)


def test_the_valid_files_work(capsys, tmp_path):
    assert show(capsys, tmp_path, "cluster", CLUSTER)[0] == 0
    assert show(capsys, tmp_path, "model", MODEL)[0] == 0


def test_misspelled_key_suggests_the_field(capsys, tmp_path):
    code, lines = show(capsys, tmp_path, "model", with_changes(MODEL, layers=None, layer=32))
    assert_problems(code, lines, "layer: unknown field (misspelled?); did you mean 'layers'?", "layers: Field required")
    nested = with_changes(CLUSTER, network=[{**CLUSTER["network"][0], "latency": 3}, CLUSTER["network"][1]])
    code, lines = show(capsys, tmp_path, "cluster", nested)
    assert code == 2 and any("network.0.latency: unknown field" in line and "latency_us" in line for line in lines)


@pytest.mark.parametrize("kind, changes, fragment", [
    ("model", {"layers": 0}, "layers: Input should be greater than 0"),
    ("model", {"hidden": -4096}, "hidden: Input should be greater than 0"),
    ("cluster", {"nodes": 0}, "nodes: Input should be greater than 0"),
    ("cluster", {"gpus_per_node": -8}, "gpus_per_node: Input should be greater than 0"),
    ("model", {"kv_heads": 5}, "heads=32 is not divisible by kv_heads=5"),
    ("model", {"hidden": 4000, "heads": 48, "kv_heads": None}, "hidden=4000 is not divisible by heads=48"),
    ("model", {"activation": "GeLU"}, "activation: Input should be"),
    # huge numbers are refused by their bounds, at once
    ("cluster", {"nodes": 10**30}, "nodes: Input should be less than or equal to"),
    ("cluster", {"nodes": 1e30}, "nodes: 1e+30 is far too large"),
    ("model", {"layers": 10**30}, "layers: Input should be less than or equal to"),
    ("model", {"vocab": 1e300}, "vocab: 1e+300 is far too large"),
    ("model", {"seq_len": 1.5}, "seq_len: Input should be a valid integer"),
    ("cluster", {"network": [{**CLUSTER["network"][0], "latency_us": float("inf")}, CLUSTER["network"][1]]},
     "network.0.latency_us: Input should be a finite number"),
])
def test_bad_values(capsys, tmp_path, kind, changes, fragment):
    base = MODEL if kind == "model" else CLUSTER
    assert_problems(*show(capsys, tmp_path, kind, with_changes(base, **changes)), fragment)


@pytest.mark.parametrize("bandwidth, fragment", [
    (400, "network.0.bandwidth: 400 has no unit; write e.g. {gbytes_per_s_per_gpu: 400}"),
    ("400 GB/s", "has no unit"),
    ({"gbps": 400}, "network.0.bandwidth.gbps: unknown field (misspelled?); valid fields: gbytes_per_s_per_gpu"),
    ({"gbytes_per_s_per_gpu": 400, "gbytes_per_s_per_node": 3200}, "give exactly one of"),
    ({"gbit_per_s_per_nic": 400}, "gbit_per_s_per_nic and nics_per_node go together"),
    ({"gbytes_per_s_per_gpu": -1}, "greater than or equal to"),
])
def test_wrong_bandwidth_units(capsys, tmp_path, bandwidth, fragment):
    network = [{**CLUSTER["network"][0], "bandwidth": bandwidth}, CLUSTER["network"][1]]
    assert_problems(*show(capsys, tmp_path, "cluster", with_changes(CLUSTER, network=network)), fragment)


def test_file_problems(capsys, tmp_path):
    assert_problems(*run(capsys, "specs", "show", str(tmp_path / "nope.yaml"), "--kind", "model"), "no such file")
    assert_problems(*show(capsys, tmp_path, "model", text="layers: 32\n  hidden: [4096\n"), "not valid YAML at line")
    assert_problems(*show(capsys, tmp_path, "model", text=""), "is empty")
    assert_problems(*show(capsys, tmp_path, "model", text="# only a comment\n"), "holds no fields")
    assert_problems(*show(capsys, tmp_path, "model", text="- 1\n- 2\n"), "must be a mapping")
    folder = tmp_path / "adir.yaml"
    folder.mkdir()
    assert_problems(*run(capsys, "specs", "show", str(folder), "--kind", "model"), "is a directory")
    bad_json = tmp_path / "m.json"
    bad_json.write_text('{"name": "x",}')
    assert_problems(*run(capsys, "specs", "show", str(bad_json), "--kind", "model"), "not valid JSON")


def test_unknown_names_suggest_the_closest(capsys, tmp_path):
    assert_problems(*run(capsys, "specs", "show", "llama3-8", "--kind", "model"), "did you mean 'llama3-8b'")
    assert_problems(*run(capsys, "specs", "show", "dgx-a100"), "did you mean")
    assert_problems(*show(capsys, tmp_path, "cluster", with_changes(CLUSTER, gpu="h100")),
                    "gpu: unknown gpu 'h100': did you mean")


def test_yaml_exponent_without_a_dot_is_a_number(capsys, tmp_path):
    text = yaml.safe_dump(CLUSTER).replace("nodes: 4", "nodes: 1e30")
    assert_problems(*show(capsys, tmp_path, "cluster", text=text), "nodes: 1e+30 is far too large")
    text = yaml.safe_dump(CLUSTER).replace("nodes: 4", "nodes: 2e1")
    code, _ = show(capsys, tmp_path, "cluster", text=text)
    assert code == 0  # 2e1 = 20 nodes, as in JSON and YAML 1.2


def test_huge_numbers_on_the_command_line(capsys):
    assert_problems(*run(capsys, "rankmap", "--cluster", "dgx-h100", "--nodes", str(10**30)),
                    "nodes: Input should be less than or equal to")
    assert_problems(*run(capsys, "rankmap", "--cluster", "dgx-h100", "--tp", str(10**30)), "does not divide")
    assert_problems(*run(capsys, "rankmap", "--cluster", "dgx-h100", "--dp", str(10**30)), "exceeds the cluster")


def test_layout_checks_stay_fast_on_large_prime_sizes():
    model = ModelSpec(name="m", layers=99_991, hidden=64, heads=1, vocab=8, seq_len=8)
    training = TrainingSpec(global_batch=999_999_937)  # a prime: nothing divides it
    start = time.perf_counter()
    problems = layout_problems(Layout(dp=2, pp=2), model, training, world_size=4)
    assert time.perf_counter() - start < 1.0
    assert any("valid dp: 1, 999999937" in p for p in problems)
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
