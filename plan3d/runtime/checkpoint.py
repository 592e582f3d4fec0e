"""Sharded, atomic, reshardable checkpoints through torch.distributed.checkpoint (DCP).

Every tensor is saved under a layout-independent key (`param/layers.3.attn.q.weight`,
`exp_avg/...`, `exp_avg_sq/...`) as a DTensor over this stage's (dp, tp) sub-mesh: replicated
over dp, split over tp along the parameter's tp dimension. DCP de-duplicates the replicas and
records global shapes, so a checkpoint written in one layout loads into any other (reshard):
each rank reads exactly the slices it needs. ZeRO 1/2 optimizer slices and ZeRO 3 parameters
are gathered over dp first (one parameter set per stage, transiently).

Atomic: all ranks write into `step_N.tmp/`; after a barrier rank 0 writes `meta.json` and renames
the directory to `step_N/`, then rewrites `latest` (write-then-rename). A crash mid-save leaves
only a `.tmp` directory, which is never loaded. The run directory must be on a file system every
node sees (as for any DCP checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from plan3d.errors import LaunchError

LATEST = "latest"


def _dtensor(t: torch.Tensor, mesh, tp_dim: int | None) -> DTensor:
    placements = [Replicate(), Shard(tp_dim) if tp_dim is not None else Replicate()]
    return DTensor.from_local(t.contiguous(), mesh, placements, run_check=False)


def save(root: Path, step: int, engine, ctx, meta: dict, written=None) -> Path:
    """Write step `step` atomically under `root`; returns the final directory. `written()` runs
    on every rank after its shards are on disk and before the commit (fault injection)."""
    state = engine.logical_state()
    mesh = ctx.mesh["dp", "tp"]
    sd = {f"{k}/{e.name}": _dtensor(state[e.name][k], mesh, e.tp_dim)
          for e in engine.entries if not e.tied_copy for k in state[e.name]}
    final, tmp = _fresh_name(root, step), root / f"step_{step:08d}.tmp"
    if ctx.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(tmp))
    if written is not None:
        written()
    dist.barrier()
    if ctx.rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}))
        os.replace(tmp, final)
        _write_latest(root, final.name)
    dist.barrier()
    return final


def _fresh_name(root: Path, step: int) -> Path:
    """step_N, or step_N-k when a run resumed from an earlier step saves step N again: a
    complete checkpoint directory is never replaced in place (`latest` names the newest)."""
    name, k = root / f"step_{step:08d}", 1
    while (root / name.name).exists():
        name, k = root / f"step_{step:08d}-{k}", k + 1
    return name


def _write_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a run/checkpoints directory whose `latest` names one."""
    for candidate in (path, path / "checkpoints"):
        if (candidate / "meta.json").exists():
            return candidate
        if (candidate / LATEST).exists():
            return candidate / (candidate / LATEST).read_text().strip()
    raise LaunchError(f"no complete checkpoint under {path}; pass a run directory that saved one "
                      "(--save-every) or a checkpoints/step_N directory")


def load(path: Path, engine, ctx) -> dict:
    """Load into this layout (resharding as needed); returns the checkpoint's meta."""
    directory = resolve(path)
    meta = json.loads((directory / "meta.json").read_text())
    mesh = ctx.mesh["dp", "tp"]
    keys = ("param",) + engine.moment_names()
    sd = {f"{k}/{e.name}": _dtensor(torch.zeros(tuple(e.param.shape), device=ctx.device), mesh, e.tp_dim)
          for e in engine.entries for k in keys}
    dcp.load(sd, checkpoint_id=str(directory))
    tensors: dict = {}
    for key, value in sd.items():
        kind, name = key.split("/", 1)
        tensors.setdefault(name, {})[kind] = value.to_local()
    engine.load_logical_state(tensors, meta["step"])
    return meta
