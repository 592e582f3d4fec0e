"""Bundled specs: GPUs, clusters, models, jobs. Resolve a name or a path; never the network.

The bundled files live at the repository root (cluster_specs/, model_specs/) and ship inside
the package as `plan3d/bundled/` (symbolic links in the source tree, copies in a wheel).
"""
from __future__ import annotations

import difflib
import math
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from plan3d.errors import SpecError, SpecNotFound
from plan3d.specs.base import MEMORY_GIB
from plan3d.specs.cluster import GPU_BY_NAME, ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.loader import read_mapping, validate
from plan3d.specs.model import ModelSpec

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"
KINDS = {"gpu": "cluster_specs/gpus", "cluster": "cluster_specs", "model": "model_specs", "engine": "engine_specs"}
DEFAULT_ENGINE = "megatron-core"  # what most large runs use today; CPU clusters: plan3d's runtime
GPU_ENGINES = (DEFAULT_ENGINE, "megatron-deepspeed", "deepspeed-0.19")  # the default, then for models it cannot build
RUNTIME_ENGINE = "plan3d-runtime"  # what `plan3d launch` trains with (and the only engine on CPU clusters)
SUFFIXES = (".yaml", ".yml", ".json")
M = TypeVar("M", bound=BaseModel)


def bundled_dir(kind: str) -> Path:
    return BUNDLED / KINDS[kind]


def bundled_names(kind: str) -> list[str]:
    folder = bundled_dir(kind)
    return sorted(p.stem for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())


def resolve_path(kind: str, name_or_path: str) -> Path:
    """A bundled name (e.g. 'dgx-h100') or a path to a YAML/JSON file."""
    candidate = Path(name_or_path).expanduser()
    looks_like_path = candidate.suffix in SUFFIXES or "/" in name_or_path or candidate.exists()
    if looks_like_path:
        return candidate
    for suffix in SUFFIXES:
        path = bundled_dir(kind) / f"{name_or_path}{suffix}"
        if path.is_file():
            return path
    names = bundled_names(kind)
    close = difflib.get_close_matches(name_or_path.lower(), names, n=1, cutoff=0.4)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise SpecNotFound(f"unknown {kind} {name_or_path!r}: {hint}bundled {kind}s: {', '.join(names)}; or give a file path")


def load_spec(kind: str, model: type[M], name_or_path: str) -> M:
    path = resolve_path(kind, name_or_path)
    return validate(model, read_mapping(path), str(path) if path.is_absolute() else path.as_posix(), lookups())


@lru_cache(maxsize=64)
def load_gpu(name: str) -> GPUSpec:
    return load_spec("gpu", GPUSpec, name)


def lookups() -> dict:
    """The validation context of a spec file: what a spec may name instead of spelling out
    (a cluster's `gpu: h100-sxm`). Give it to `loader.validate` for a file that holds specs."""
    return {GPU_BY_NAME: load_gpu}


def load_cluster(name_or_path: str, nodes: int | None = None, gpus_per_node: int | None = None) -> ClusterSpec:
    """A cluster spec, optionally resized (the spec describes node type and fabric)."""
    return resize(load_spec("cluster", ClusterSpec, name_or_path), nodes, gpus_per_node, name_or_path)


def resize(cluster: ClusterSpec, nodes: int | None, gpus_per_node: int | None, source: str) -> ClusterSpec:
    """`cluster.with_size(...)`, with a bad size reported as a SpecError naming `source`."""
    if nodes is None and gpus_per_node is None:
        return cluster
    try:
        return cluster.with_size(nodes, gpus_per_node)
    except SpecError as err:
        raise SpecError(f"{source} (with size overrides)", err.problems) from err


def load_model(name_or_path: str) -> ModelSpec:
    return load_spec("model", ModelSpec, name_or_path)


@lru_cache(maxsize=64)
def load_engine(name_or_path: str) -> EngineSpec:
    return load_spec("engine", EngineSpec, name_or_path)


def engine_for(name_or_path: str | None, cluster: ClusterSpec, model: ModelSpec | None = None) -> EngineSpec:
    """The engine named, or the default: on GPUs the first of GPU_ENGINES whose model code builds
    `model` (Megatron-Core; BLOOM's ALiBi: Megatron-DeepSpeed, its own engine), plan3d's runtime
    where the "GPU" is a CPU process (no other engine trains there). Where none builds it, the
    first, whose refusal then says why."""
    if name_or_path:
        return load_engine(name_or_path)
    if not cluster.gpu.compute_efficiency.host_overlap:
        return load_engine(RUNTIME_ENGINE)
    engines = [load_engine(name) for name in GPU_ENGINES]
    builds = [engine for engine in engines if model is None or not engine.model_problems(model)]
    return (builds or engines)[0]


def bundled_engine_or_none(name: str) -> EngineSpec | None:
    """The bundled engine profile of that name, or None (a spec file's engine, a renamed one)."""
    try:
        return load_engine(name) if "/" not in name and not name.endswith((".yaml", ".yml", ".json")) else None
    except (SpecError, SpecNotFound):
        return None


def with_gpu_memory(cluster: ClusterSpec, gib: float | None) -> ClusterSpec:
    """`cluster` with its GPUs' memory set to `gib` GiB (`--gpu-memory`: the 94 GB H100 NVL, the
    96 GB GH200, the 141 GB H200 or 180/192 GB B200 on a cluster spec written for another size);
    None leaves it. A value outside the GPU spec's memory range is one SpecError line."""
    if gib is None:
        return cluster
    low, high = MEMORY_GIB["ge"], MEMORY_GIB["le"]
    if not (isinstance(gib, (int, float)) and math.isfinite(gib) and low <= gib <= high):
        raise SpecError("command line", [f"--gpu-memory {gib}: give the GPU's memory in GiB, a number from {low:g} "
                                         f"to {high:g}, e.g. 94 for an H100 NVL"])
    gpu = cluster.gpu.model_copy(update={"memory_gib": float(gib)})
    return cluster.model_copy(update={"gpu": gpu})


def require_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise SpecError("command line", [f"--{name.replace('_', '-')} must be a positive integer, got {value}"])
