"""Tensor parallelism with sequence parallelism, hand-written (Megatron-LM style).

Shoeybi et al. 2019 (Megatron-LM, arXiv:1909.08053) section 3: a column-parallel linear needs the
identity forward / all-reduce backward operator `f` on its input, a row-parallel linear the
all-reduce forward / identity backward operator `g` on its output. Korthikanti et al. 2022
(arXiv:2205.05198) section 4.2.2: with sequence parallelism `f` becomes an all-gather along the
sequence (backward: reduce-scatter) and `g` a reduce-scatter (backward: all-gather), and the
norms run on sequence shards. Vocabulary-parallel embedding and cross-entropy follow Megatron's
`VocabParallelEmbedding` and `_VocabParallelCrossEntropy` (max / sum-exp / target logit each
all-reduced over the tp group).

Why hand-written and not DTensor `parallelize_module`: on torch 2.13 CPU the DTensor path is
about 2x slower for small models and cannot share one Adam (foreach) with plain parameters, and
the DDP wrapper rejects DTensor parameters (torch-notes.md). Activations are batch-first
[batch, seq, hidden]; the sequence dimension is 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plan3d.runtime.comm import all_gather_flat, reduce_scatter_flat
from torch.autograd import Function

SEQ_DIM = 1


@dataclass(frozen=True)
class TPInfo:
    """This rank's tensor-parallel facts; `group` is None when tp == 1."""

    size: int
    rank: int
    group: object | None
    sequence_parallel: bool


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """All-gather sequence shards [b, s/tp, h] -> [b, s, h]."""
    local = x.transpose(0, SEQ_DIM).contiguous()
    out = local.new_empty((local.shape[0] * tp.size,) + tuple(local.shape[1:]))
    all_gather_flat(out, local, group=tp.group)
    return out.transpose(0, SEQ_DIM).contiguous()


def _scatter_seq(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Reduce-scatter partial sums [b, s, h] -> this rank's summed shard [b, s/tp, h]."""
    full = x.transpose(0, SEQ_DIM).contiguous()
    out = full.new_empty((full.shape[0] // tp.size,) + tuple(full.shape[1:]))
    reduce_scatter_flat(out, full, group=tp.group)
    return out.transpose(0, SEQ_DIM).contiguous()


class _Enter(Function):
    """Megatron's `f`: identity / all-reduce, or with SP all-gather / reduce-scatter."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp) if tp.sequence_parallel else x

    @staticmethod
    def backward(ctx, grad):
        tp = ctx.tp
        return (_scatter_seq(grad, tp) if tp.sequence_parallel else _all_reduce(grad, tp.group)), None


class _Exit(Function):
    """Megatron's `g`: all-reduce / identity, or with SP reduce-scatter / all-gather."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _scatter_seq(x, tp) if tp.sequence_parallel else _all_reduce(x, tp.group)

    @staticmethod
    def backward(ctx, grad):
        tp = ctx.tp
        return (_gather_seq(grad, tp) if tp.sequence_parallel else grad), None


def enter(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Input of column-parallel layers: full activations on every tp rank."""
    return x if tp.size == 1 else _Enter.apply(x, tp)


def exit_(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Output of row-parallel layers: summed partials (sequence-sharded with SP)."""
    return x if tp.size == 1 else _Exit.apply(x, tp)


def seq_shard(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """This rank's sequence chunk of a replicated tensor (no communication)."""
    if not tp.sequence_parallel:
        return x
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank]


def vocab_embedding(tokens: torch.Tensor, weight: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Rows [rank*V/tp, (rank+1)*V/tp) live here; other tokens give zeros, summed by `exit_`."""
    if tp.size == 1:
        return torch.nn.functional.embedding(tokens, weight)
    start = tp.rank * weight.shape[0]
    local = tokens - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return exit_(out.masked_fill(outside.unsqueeze(-1), 0.0), tp)


class _VocabParallelCE(Function):
    """Per-token cross-entropy of vocabulary-sharded logits [b, s, V/tp]."""

    @staticmethod
    def forward(ctx, logits, target, tp):
        logits = logits.float()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - top.unsqueeze(-1)
        start = tp.rank * logits.shape[-1]
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.masked_fill(~inside, 0).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=tp.group)
        dist.all_reduce(picked, group=tp.group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), index, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, index, inside = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, index, inside.unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Mean token loss; vocabulary-parallel when tp > 1."""
    if tp.size == 1:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    return _VocabParallelCE.apply(logits, target, tp).mean()


class _GatherReplicated(Function):
    """Sequence shards [b, s/tp, h] -> the full sequence on every tp rank; backward: this rank's
    chunk of the gradient, no sum (the region after it is replicated: every tp rank computes the
    same values and the same full gradients, as the MoE layer does, `runtime/moe.py`)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=SEQ_DIM)[ctx.tp.rank].contiguous(), None


class _ShardReplicated(Function):
    """The inverse: a replicated full sequence -> this rank's shard; backward all-gathers the
    shards' gradients, so the replicated region sees the full gradient on every tp rank."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


def gather_replicated(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Into a tp-replicated region: the full sequence under sequence parallelism, else `x`."""
    return _GatherReplicated.apply(x, tp) if tp.sequence_parallel and tp.size > 1 else x


def shard_replicated(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Out of a tp-replicated region: this rank's sequence shard under sequence parallelism."""
    return _ShardReplicated.apply(x, tp) if tp.sequence_parallel and tp.size > 1 else x


def without_sequence_parallel(tp: TPInfo) -> TPInfo:
    """The same tp group with plain (all-reduce) `enter`/`exit_` operators."""
    return TPInfo(tp.size, tp.rank, tp.group, False)
