"""Measured memory of one rank: exact model-state bytes and the peak."""
from __future__ import annotations

import resource

import torch


def peak_bytes(device: torch.device) -> int:
    """Peak allocated device memory (GPU) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def model_state(engine) -> dict[str, int]:
    """{weights, gradients, optimizer, total} bytes this rank holds (ZeRO-aware, see dp.py)."""
    state = engine.state_bytes()
    return {**state, "total": sum(state.values())}
