"""Context parallelism: each sample's sequence is split over the cp ranks; attention gathers K/V
(all_gather) or passes them round a ring (p2p).

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
sequence in memory on each rank (torchtitan 0.3's FlexAttention CP does the same).

Ring (`ring_attention`, `--cp-comm p2p`): Megatron-Core's default exchange
(`TransformerConfig.cp_comm_type` "p2p", Transformer Engine AttnFuncWithCPAndKVP2P; Liu et al.
2023, Ring Attention, arXiv 2310.01889). In cp steps a rank attends its queries to one block of
K/V (its own first, then those of cp rank r-1, r-2, ...) under the global-position mask, keeping
each block's output and log-sum-exp, and merges them as flash attention merges tiles
(out = sum_j exp(lse_j - lse) * out_j, lse = logsumexp_j lse_j); between steps each rank sends its
current K/V block to cp rank r+1 and receives the next from r-1 (`_RingShift`, whose backward
sends the gradient the other way). Here the shift is synchronous (no overlap with the block's
attention, unlike TE's streams), and autograd keeps every block it saw, so memory is that of
all_gather; what it checks is the exchange and the merge, exactly.

Gradients are reduced over dp x cp (Megatron's "data-parallel group with context parallel",
`parallel_state.get_data_parallel_group(with_context_parallel=True)`), and the distributed
optimizer / ZeRO shards over that group too (Megatron-Core `optimizer/__init__.py` passes
`intra_dp_cp_group` to `DistributedOptimizer`; torchtitan 0.3 folds cp into its FSDP mesh,
`parallel_dims.py` `fsdp = dp_shard * cp`). Each cp rank's loss is the mean over its s/cp tokens,
so the mean over cp ranks is the mean over all tokens of the sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
    comm: str = "all_gather"  # the K/V exchange: all_gather or p2p (the ring)


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


# ---- the ring (p2p) --------------------------------------------------------------------------------
def _shift(x: torch.Tensor, cp: CPInfo, step: int) -> torch.Tensor:
    """Send `x` `step` places along the cp ring (to cp rank r+step) and return what arrives from
    cp rank r-step. Paired isend/irecv in one batch, so no rank waits on another's order."""
    group_ranks = dist.get_process_group_ranks(cp.group)
    dst = group_ranks[(cp.rank + step) % cp.size]
    src = group_ranks[(cp.rank - step) % cp.size]
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, cp.group), dist.P2POp(dist.irecv, out, src, cp.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class _RingShift(Function):
    """One step of the ring: forward passes a block to cp rank r+1; backward returns its gradient
    to where it came from (cp rank r-1 passed it here, so the gradient goes back one step)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _shift(x, cp, 1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.cp, -1), None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Attention of q [b, h, sq, d] to one block k, v [b, h, sk, d] under `mask` [sq, sk]: the
    block's output and its log-sum-exp per query [b, h, sq] (a fully masked row gets a log-sum-exp
    of about -1e30, so its weight in the merge is zero), in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


MASKED = -1e30  # a masked score: finite, so a fully masked row does not turn into NaN


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Two partial attentions over disjoint key sets as one (flash attention's tile merge)."""
    total = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - total).unsqueeze(-1) + block_out * torch.exp(block_lse - total).unsqueeze(-1),
            total)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPInfo, query_pos: torch.Tensor,
                   attend=block_attention) -> torch.Tensor:
    """Local queries q [b, h, s/cp, d] (global positions `query_pos`) against every cp rank's K/V,
    passed round the ring; `attend` computes one block (a checkpointed wrapper under selective
    recompute: the shifts stay outside it, so no collective is replayed)."""
    seq = q.shape[-2] * cp.size
    out = lse = None
    for step in range(cp.size):
        if step:
            k, v = _RingShift.apply(k, cp), _RingShift.apply(v, cp)
        key_pos = positions(seq, cp.size, (cp.rank - step) % cp.size, q.device)
        block_out, block_lse = attend(q, k, v, causal_mask(query_pos, key_pos))
        out, lse = (block_out, block_lse) if out is None else merge_blocks(out, lse, block_out, block_lse)
    return out.to(q.dtype)
