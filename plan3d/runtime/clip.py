"""Global gradient-norm clipping equal to the single-process norm.

Every rank adds the squares of the gradient elements it is the one owner of (tp replicas and dp
replicas counted once, ZeRO shards each once, the tied embedding copy not at all), the sum is
all-reduced over the world, and every rank scales by min(1, max_norm / (norm + 1e-6)), exactly as
`torch.nn.utils.clip_grad_norm_` does in one process (Megatron-LM `clip_grad_norm_fp32`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from plan3d.runtime.engine import DataParallel


def clip_global_norm(dp_engine: DataParallel, max_norm: float) -> float:
    """Clip in place; return the global norm before clipping."""
    total = dp_engine.grad_sq_sum().reshape(1).float()
    dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm > 0:
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        if coef < 1.0:
            dp_engine.scale_grads(coef)
    return float(norm)
