"""Flat all-gather / reduce-scatter under their torch >= 2.13 names, older names otherwise
(torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor`)."""
from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
