"""Sharded, atomic, reshardable checkpoints through torch.distributed.checkpoint (DCP).

Every tensor is saved under a layout-independent key (`param/layers.3.attn.q.weight`,
`exp_avg/...`, `exp_avg_sq/...`) as a DTensor over this stage's (dp, tp) sub-mesh: replicated
over dp, split over tp along the parameter's tp dimension; a routed expert's (each expert its own
keys, `layers.3.mlp.experts.5.up.weight`) over its (edp, tp) sub-mesh, so a checkpoint written
under one ep loads under another. DCP de-duplicates the replicas and
records global shapes, so a checkpoint written in one layout loads into any other (reshard):
each rank reads exactly the slices it needs. ZeRO 1/2 optimizer slices and ZeRO 3 parameters
are gathered over dp first (one parameter set per stage, transiently).

Atomic: all ranks write into `step_N.tmp/`; after a barrier rank 0 writes `meta.json` and renames
the directory to `step_N/`, then rewrites `latest` (write-then-rename). A crash mid-save leaves
only a `.tmp` directory, which is never loaded (the launcher removes it at the next start). The
run directory must be on a file system every node sees (as for any DCP checkpoint).

Verified: every rank hashes the shards it wrote; `meta.json` records the SHA-256 of every file,
and a load refuses a damaged checkpoint (naming the file and the previous good checkpoint)
before DCP reads it (`plan3d/run/checkpoints.py`, torch-free, which the launcher also uses).
Retention: with `--keep-last N` rank 0 deletes the oldest complete checkpoints after a commit.
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

from plan3d.run import checkpoints as files
from plan3d.run.checkpoints import CheckpointError

LATEST = files.LATEST


def _dtensor(t: torch.Tensor, mesh, tp_dim: int | None) -> DTensor:
    """Replicated over every dimension of `mesh` but the last (tp), split over tp along `tp_dim`."""
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(tp_dim) if tp_dim is not None else Replicate()]
    return DTensor.from_local(t.contiguous(), mesh, placements, run_check=False)


def _state_mesh(ctx, expert: bool = False):
    """The stage's (dp, tp) sub-mesh, (dp, cp, tp) with context parallelism (cp ranks hold replicas);
    for a routed expert's tensors the (edp, tp) sub-mesh of the ranks holding that expert."""
    if expert:
        return ctx.expert_mesh["edp", "tp"]
    return ctx.mesh["dp", "cp", "tp"] if ctx.cp.size > 1 else ctx.mesh["dp", "tp"]


def save(root: Path, step: int, engine, ctx, meta: dict, written=None, keep_last: int = 0) -> Path:
    """Write step `step` atomically under `root`; returns the final directory. `written()` runs
    on every rank after its shards are on disk and before the commit (fault injection)."""
    state = engine.logical_state()
    meshes = {False: _state_mesh(ctx), True: _state_mesh(ctx, expert=True) if ctx.expert_mesh else None}
    sd = {f"{k}/{e.name}": _dtensor(state[e.name][k], meshes[e.expert], e.tp_dim)
          for e in engine.entries if not e.tied_copy for k in state[e.name]}
    final, tmp = _fresh_name(root, step), root / f"step_{step:08d}.tmp"
    if ctx.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(tmp))
    if written is not None:
        written()
    checksums = _gather_checksums(tmp, ctx.rank)
    if ctx.rank == 0:
        (tmp / files.META).write_text(json.dumps({"step": step, **meta, "checksums": checksums}))
        os.replace(tmp, final)
        _write_latest(root, final.name)
        files.prune(root, keep_last, protect=final)
    dist.barrier()
    return final


def _gather_checksums(directory: Path, rank: int) -> dict[str, str] | None:
    """On rank 0: the SHA-256 of every file of the checkpoint, each rank hashing its own shards
    (`__<rank>_<i>.distcp`); rank 0 also hashes what no rank claimed (`.metadata`)."""
    mine = files.shard_checksums(directory, [p.name for p in directory.glob(f"__{rank}_*")])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    checksums = {name: digest for part in gathered for name, digest in part.items()}
    checksums.update(files.shard_checksums(directory, files.unlisted_files(directory, checksums)))
    return checksums


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
    """The checkpoint directory `path` names (see plan3d.run.checkpoints.resolve)."""
    return files.resolve(path)


def _verified_everywhere(path: Path, rank: int) -> Path:
    """Rank 0 checks the shards' checksums; every rank gets the same verdict (one message)."""
    verdict = [None]
    if rank == 0:
        try:
            verdict[0] = str(files.verified(path))
        except CheckpointError as err:
            verdict[0] = err
    dist.broadcast_object_list(verdict, src=0)
    if isinstance(verdict[0], CheckpointError):
        raise verdict[0]
    return Path(verdict[0])


def load(path: Path, engine, ctx) -> dict:
    """Load into this layout (resharding as needed); returns the checkpoint's meta."""
    directory = _verified_everywhere(path, ctx.rank)
    meta = json.loads((directory / files.META).read_text())
    meshes = {False: _state_mesh(ctx), True: _state_mesh(ctx, expert=True) if ctx.expert_mesh else None}
    keys = ("param",) + engine.moment_names()
    sd = {f"{k}/{e.name}": _dtensor(torch.zeros(tuple(e.param.shape), device=ctx.device), meshes[e.expert], e.tp_dim)
          for e in engine.entries for k in keys}
    dcp.load(sd, checkpoint_id=str(directory))
    tensors: dict = {}
    for key, value in sd.items():
        kind, name = key.split("/", 1)
        tensors.setdefault(name, {})[kind] = value.to_local()
    engine.load_logical_state(tensors, meta["step"])
    return meta
