"""Every bundled spec loads and round-trips; the JSON Schemas are valid and accept the bundled files."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from plan3d.cli import main
from plan3d.specs import catalog
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.loader import parse_mapping, read_mapping, validate
from plan3d.specs.model import ModelSpec

MODELS = {"gpu": GPUSpec, "cluster": ClusterSpec, "model": ModelSpec}
BUNDLED = [(kind, name) for kind in MODELS for name in catalog.bundled_names(kind)]
REPO = Path(__file__).resolve().parent.parent

# names that scripts and docs rely on (issue 2)
REQUIRED_NAMES = {
    "cluster": {"dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "h200", "gb200-nvl72", "mi300x", "local-cpu"},
    "model": {"gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "bloom-176b", "opt-175b", "gpt-neox-20b",
              "tiny-gpt"},
    "gpu": {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "gb200", "mi300x"},
}


def test_catalog_has_the_promised_names():
    for kind, names in REQUIRED_NAMES.items():
        assert names <= set(catalog.bundled_names(kind)), kind


def test_package_ships_the_same_files_as_the_repository():
    for kind, folder in catalog.KINDS.items():
        repo_files = sorted(p.name for p in (REPO / folder).iterdir() if p.is_file())
        assert sorted(p.name for p in catalog.bundled_dir(kind).iterdir() if p.is_file()) == repo_files


@pytest.mark.parametrize("kind, name", BUNDLED, ids=[f"{k}:{n}" for k, n in BUNDLED])
def test_bundled_spec_round_trips(kind, name):
    spec = catalog.load_spec(kind, MODELS[kind], name)
    assert spec.source, f"{kind} {name} must say where its figures come from"
    assert MODELS[kind].model_validate(spec.model_dump()) == spec
    as_yaml = yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
    assert validate(MODELS[kind], parse_mapping(as_yaml, name), name) == spec
    as_json = spec.model_dump_json()
    assert validate(MODELS[kind], parse_mapping(as_json, name, json_only=True), name) == spec


@pytest.mark.parametrize("name", catalog.bundled_names("cluster"))
def test_bundled_cluster_tiers_are_in_si_units(name):
    cluster = catalog.load_cluster(name)
    tiers = cluster.tiers()
    assert tiers[-1].domain_gpus >= cluster.world_size
    assert all(1e8 < t.bandwidth_bytes_per_s < 1e13 for t in tiers)  # 0.1 GB/s .. 10 TB/s per GPU
    assert all(0 <= t.latency_s < 1e-2 for t in tiers)  # microseconds (gloo on a busy CPU: ~1 ms), never seconds
    assert [t.bandwidth_bytes_per_s for t in tiers] == sorted((t.bandwidth_bytes_per_s for t in tiers), reverse=True)


def test_bandwidth_forms_convert_to_the_same_bytes_per_s():
    """400 Gbit/s x 8 NICs over 8 GPUs = 50 GB/s per GPU = 400 GB/s per node; NVLink 900 bidirectional = 450."""
    from plan3d.specs.cluster import Bandwidth

    per_gpu = [Bandwidth(gbit_per_s_per_nic=400, nics_per_node=8), Bandwidth(gbytes_per_s_per_gpu=50),
               Bandwidth(gbytes_per_s_per_node=400)]
    assert {b.bytes_per_s_per_gpu(8) for b in per_gpu} == {50e9}
    assert Bandwidth(gbytes_per_s_per_gpu=900, bidirectional=True).bytes_per_s_per_gpu(8) == 450e9


def test_cli_overrides_resize_the_cluster():
    cluster = catalog.load_cluster("dgx-h100", nodes=3, gpus_per_node=4)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.world_size) == (3, 4, 12)
    assert cluster.tiers()[0].domain_gpus == 4


def schema_output(capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["specs", "schema"])
    assert (exit_info.value.code or 0) == 0
    return json.loads(capsys.readouterr().out)


def test_schema_is_valid_json_schema_and_accepts_bundled_files(capsys):
    schemas = schema_output(capsys)
    assert {"cluster", "gpu", "model", "training", "layout", "job"} <= set(schemas)
    for kind, schema in schemas.items():
        jsonschema.validators.validator_for(schema).check_schema(schema)
    for kind, name in BUNDLED:  # the files as users write them (a cluster names its GPU)
        raw = read_mapping(catalog.resolve_path(kind, name))
        jsonschema.validate(raw, schemas[kind])
    bad = {"name": "x", "layers": 0, "hidden": 8, "heads": 1, "vocab": 8, "seq_len": 8, "typo": 1}
    errors = list(jsonschema.validators.validator_for(schemas["model"])(schemas["model"]).iter_errors(bad))
    assert len(errors) == 2  # layers > 0, and no unknown keys


def test_job_file_resolves_names_and_relative_paths(tmp_path):
    from plan3d.job import load_job

    model_file = tmp_path / "mine.yaml"
    model_file.write_text(yaml.safe_dump(catalog.load_model("tiny-gpt").model_dump(mode="json")))
    job = tmp_path / "job.yaml"
    job.write_text("cluster: dgx-h100\nnodes: 2\nmodel: mine.yaml\ntraining: {global_batch: 16}\n"
                   "layout: {tp: 2, dp: 8}\n")
    loaded = load_job(str(job))
    assert loaded.cluster.world_size == 16 and loaded.model == catalog.load_model("tiny-gpt")
    assert loaded.layout.tp == 2
