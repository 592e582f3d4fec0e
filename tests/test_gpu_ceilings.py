"""GEMM ceilings of the GPU generations no calibration run measures: the A100's fitted
max_fraction carried over by each GPU's measured MAMF share (gpu.py ComputeEfficiency), in the
bundled specs and in the benchmark's fit (benchmarks/published.py mamf_tied_ceiling)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plan3d.specs.catalog import bundled_names, load_gpu

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"
A100S = ("a100-80gb", "a100-40gb")


def test_every_gpu_with_a_mamf_share_carries_the_a100_ceiling_scaled_by_it():
    a100 = load_gpu("a100-80gb").compute_efficiency
    tied = [name for name in bundled_names("gpu")
            if load_gpu(name).compute_efficiency.mamf_fraction is not None and name not in A100S]
    assert {"h100-sxm", "h200", "b200", "gb200"} <= set(tied)
    for name in tied:
        eff = load_gpu(name).compute_efficiency
        assert eff.max_fraction == pytest.approx(a100.max_fraction * eff.mamf_fraction / a100.mamf_fraction, abs=1e-4), name


def test_a_gpu_without_a_measured_mamf_keeps_the_default_ceiling():
    eff = load_gpu("h100-nvl").compute_efficiency
    assert eff.mamf_fraction is None and eff.max_fraction == 0.75


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARK.parent))
        spec = importlib.util.spec_from_file_location("published_benchmark", BENCHMARK)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


def test_the_fit_moves_the_hopper_ceiling_with_the_a100_one(published):
    h100 = load_gpu("h100-sxm")
    assert published.mamf_tied_ceiling(h100, {"a100.max_fraction": 0.6}) == {"max_fraction": pytest.approx(0.6 * 0.801 / 0.859)}
    assert published.mamf_tied_ceiling(load_gpu("a100-80gb"), {"a100.max_fraction": 0.6}) == {}  # its own fit key
    assert published.mamf_tied_ceiling(load_gpu("h100-nvl"), {"a100.max_fraction": 0.6}) == {}
    params = published.bundled_params() | {"a100.max_fraction": 0.6}
    cluster = published._cluster("dgx-h100", 8, tuple(sorted(params.items())))
    assert cluster.gpu.compute_efficiency.max_fraction == pytest.approx(0.6 * 0.801 / 0.859)
