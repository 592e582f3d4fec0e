"""A deterministic, learnable synthetic token stream whose global batch is the same in every layout.

Each sequence follows a fixed random successor table (token -> next token) with 10% random
replacements, so a model can learn it and the loss falls. The global batch of step `step` is
drawn from a generator seeded by (seed, step) on the CPU; data-parallel rank d takes rows
[d*G/dp, (d+1)*G/dp). Every layout sees the same tokens, so losses are comparable.
"""
from __future__ import annotations

import torch


def global_batch(seed: int, step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """[batch, seq + 1] tokens of step `step` (inputs = [:, :-1], targets = [:, 1:])."""
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 7919 + step + 1)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    noise = torch.rand(batch, seq, generator=gen) < 0.1
    random = torch.randint(vocab, (batch, seq), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = torch.where(noise[:, t], random[:, t], table[tokens[:, t]])
    return tokens


def replica_batch(seed: int, step: int, batch: int, seq: int, vocab: int, dp: int, dp_rank: int):
    """(inputs, targets) of this data-parallel replica."""
    rows = global_batch(seed, step, batch, seq, vocab).chunk(dp)[dp_rank]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
