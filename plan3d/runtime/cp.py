"""Context parallelism: each sample's sequence is split over the cp ranks; attention all-gathers K/V.

Layout of the sequence (Megatron-Core 0.19.2's convention: `megatron/core/utils.py`
`get_batch_on_this_cp_rank` -> `_get_batch_on_this_cp_rank_per_sequence_balancing` cuts every
sequence into 2*cp chunks and cp rank r keeps chunks r and 2*cp-1-r, so that under a causal mask
every rank does the same attention work; it requires seq % (2*cp) == 0): this rank's local
sequence is [chunk r | chunk 2*cp-1-r], s/cp tokens. Inputs and targets are split alike, position
embeddings and RoPE use the GLOBAL positions of the kept chunks (`positions`), and the causal mask
compares global positions (`causal_mask`).

Attention (`gather_sequence`): every cp rank all-gathers K and V of the whole sequence over its cp
group in the forward (an autograd function; the backward reduce-scatters dK and dV, so each rank
gets the sum of every rank's gradient for its own chunks), then attends its local queries to all
keys under the global-position causal mask. Exact and deterministic; the cost is K/V of the whole
sequence in memory on each rank. Megatron-Core instead passes K/V around the cp ring with P2P
sends overlapped with the attention of the previous block (`TransformerConfig.cp_comm_type`
"p2p", the default of `extensions/transformer_engine.py` `TEDotProductAttention`, run by
Transformer Engine); it also offers "all_gather" (this scheme, not
overlapped), "a2a" (Ulysses-style head scatter) and "a2a+p2p".

Gradients are reduced over dp x cp (Megatron's "data-parallel group with context parallel",
`parallel_state.get_data_parallel_group(with_context_parallel=True)`), and the distributed
optimizer / ZeRO shards over that group too (Megatron-Core `optimizer/__init__.py` passes
`intra_dp_cp_group` to `DistributedOptimizer`; torchtitan 0.3 folds cp into its FSDP mesh,
`parallel_dims.py` `fsdp = dp_shard * cp`). Each cp rank's loss is the mean over its s/cp tokens,
so the mean over cp ranks is the mean over all tokens of the sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Function

from plan3d.errors import LaunchError
from plan3d.runtime.comm import all_gather_flat, reduce_scatter_flat

SEQ_DIM = 1  # tokens [b, s], activations [b, s, h]


@dataclass(frozen=True)
class CPInfo:
    """This rank's context-parallel facts; `group` is None when cp == 1."""

    size: int = 1
    rank: int = 0
    group: object | None = None


def seq_problem(seq: int, cp: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split over `cp` ranks, or None."""
    if cp > 1 and seq % (2 * cp):
        return (f"context parallelism cp={cp} cuts each sequence into 2*cp={2 * cp} chunks, "
                f"but seq={seq} is not divisible by {2 * cp}; choose a seq_len or cp that divides")
    return None


def check_seq(seq: int, cp: int) -> None:
    problem = seq_problem(seq, cp)
    if problem:
        raise LaunchError(problem)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2*cp sequence chunks cp rank `rank` holds (Megatron's load balancing)."""
    return rank, 2 * cp - 1 - rank


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """This cp rank's part of a full sequence: chunks r and 2*cp-1-r, concatenated."""
    if cp == 1:
        return x
    check_seq(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim).contiguous()


def merge_sequence(parts: list[torch.Tensor], dim: int = SEQ_DIM) -> torch.Tensor:
    """The full sequence from every cp rank's part (the inverse of `split_sequence`)."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        low, high = chunk_ids(cp, rank)
        chunks[low], chunks[high] = first, second
    return torch.cat(chunks, dim=dim)


def positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [s/cp] of the tokens cp rank `rank` holds of a `seq`-token sequence."""
    return split_sequence(torch.arange(seq, device=device), cp, rank, dim=0)


def gathered_positions(seq: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [s] of the keys after `gather_sequence` (cp rank order, as gathered)."""
    return torch.cat([positions(seq, cp, r, device) for r in range(cp)])


def causal_mask(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """[sq, sk] True where the query may attend to the key: key position <= query position."""
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)


def _gather(x: torch.Tensor, cp: CPInfo, dim: int) -> torch.Tensor:
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((local.shape[0] * cp.size,) + tuple(local.shape[1:]))
    all_gather_flat(out, local, group=cp.group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, cp: CPInfo, dim: int) -> torch.Tensor:
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // cp.size,) + tuple(full.shape[1:]))
    reduce_scatter_flat(out, full, group=cp.group)
    return out.movedim(0, dim)


class _GatherSequence(Function):
    """All-gather along `dim` over the cp group; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, cp, dim):
        ctx.cp, ctx.dim = cp, dim
        return _gather(x, cp, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.cp, ctx.dim).contiguous(), None, None


def gather_sequence(x: torch.Tensor, cp: CPInfo, dim: int) -> torch.Tensor:
    """Every cp rank's local sequence of `x`, concatenated along `dim` in cp rank order."""
    return x if cp.size == 1 else _GatherSequence.apply(x, cp, dim)
