"""Collectives on flat buffers.

Flat all-gather / reduce-scatter under their torch >= 2.13 names, older names otherwise
(torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in one all-reduce per dtype (a flat bucket, as Megatron-LM's
    gradient buffers and DDP's buckets do): one latency instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
