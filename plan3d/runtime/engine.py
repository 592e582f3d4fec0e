"""The contract between the training loop and its data-parallel engine.

`Entry` is one parameter of this rank under its layout-independent name; `DataParallel` is what
every engine (ZeRO 0 `dp.ReplicatedDP`, ZeRO 1/2 and bf16 `zero.FlatZeroDP`, ZeRO 3
`dp.FullyShardedDP`) offers to `train.py`, `clip.py`, `memory.py` and `checkpoint.py`.
Engines depend on this module, never on each other.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from plan3d.runtime.comm import all_reduce_coalesced
from plan3d.runtime.context import ParallelContext
from plan3d.runtime.model import TIED, logical_name


@dataclass
class Entry:
    """One parameter of this rank: its logical name, tensor, tp split dim, whether this rank
    counts it in the global gradient norm (tp replicas and the tied copy are counted once),
    whether it is the last stage's copy of the tied embedding (not saved: the first stage's is),
    whether it is a copy of the token embedding (summed over the embedding group when
    the embeddings are tied over pipeline stages), whether it belongs to a routed expert (reduced
    and sharded over the expert-data-parallel group, `runtime/moe.py`), and whether its gradient
    is already whole on every tp rank (an MoE layer's replicated parameters: not summed over tp
    under sequence parallelism)."""

    name: str
    param: nn.Parameter
    tp_dim: int | None
    counted: bool
    tied_copy: bool
    embedding: bool = False
    expert: bool = False
    tp_full_grad: bool = False


LogicalState = dict[str, dict[str, torch.Tensor]]


class DataParallel(Protocol):
    """A data-parallel engine as the training loop uses it, once per step in this order:
    zero_grad, (forward and backward), reduce_grads, grad_sq_sum / scale_grads (clipping), step."""

    entries: list[Entry]
    collects_grads: bool
    """True when backward hooks move gradients out of `param.grad` into the engine's own buffer,
    so the pipeline schedule must not scale `param.grad` (the engine divides instead)."""

    def zero_grad(self) -> None: ...

    def reduce_grads(self) -> None:
        """Model-parallel then data-parallel gradient reduction (mean over dp)."""

    def grad_sq_sum(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (each element counted once)."""

    def scale_grads(self, coef: float) -> None: ...

    def step(self) -> None:
        """The optimizer update, after which every rank holds the updated parameters."""

    def state_bytes(self) -> dict[str, int]:
        """{weights, gradients, optimizer} bytes this rank holds."""

    def moment_names(self) -> tuple[str, ...]: ...

    def logical_state(self) -> LogicalState:
        """Per logical name: the fp32 parameter and optimizer moments, full over dp, this rank's tp slice."""

    def load_logical_state(self, tensors: LogicalState, step: int) -> None: ...


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def collect_entries(stages, ctx: ParallelContext) -> list[Entry]:
    """Entries of every parameter of this rank's stages (read the tags BEFORE any FSDP wrapping)."""
    entries = []
    for stage in stages:
        for name, p in stage.named_parameters():
            tied_copy = name == stage.tied_copy
            counted = (p.tp_dim is not None or ctx.tp.rank == 0) and not tied_copy
            logical = logical_name(stage, name)
            entries.append(Entry(logical, p, p.tp_dim, counted, tied_copy, embedding=logical == TIED,
                                 expert=getattr(p, "expert", False), tp_full_grad=getattr(p, "tp_full_grad", False)))
    return entries


def rebind_entries(entries: list[Entry], stages) -> None:
    """After FSDP wrapping the parameter objects change; point each entry at the parameter of
    the same logical name (FSDP2's `fully_shard` keeps the parameter names)."""
    params = {logical_name(stage, name): p for stage in stages for name, p in stage.named_parameters()}
    names = [e.name for e in entries]
    if len(set(names)) != len(names) or set(names) != set(params):
        raise RuntimeError(f"the wrapped stages' parameters {sorted(params)} are not the entries {sorted(names)}")
    for e in entries:
        e.param = params[e.name]


def reduce_model_parallel_grads(entries: list[Entry], ctx: ParallelContext,
                                grad_of: Callable[[Entry], torch.Tensor | None] | None = None) -> None:
    """Sum sequence-parallel partial grads of tp-replicated params (one bucket, as Megatron-LM's
    `_allreduce_layernorm_grads`); sum the tied embedding copies over the embedding group.
    `grad_of(entry)` names where an entry's gradient lives (default: `param.grad`)."""
    replicated = []
    for e in entries:
        grad = grad_of(e) if grad_of else e.param.grad
        if grad is None:
            continue
        grad = local_tensor(grad)
        if ctx.tp.sequence_parallel and e.tp_dim is None and not e.tp_full_grad:
            replicated.append(grad)
        if ctx.embedding_group is not None and e.embedding:
            dist.all_reduce(grad, group=ctx.embedding_group)
    if replicated:
        all_reduce_coalesced(replicated, ctx.tp.group)
