"""A deterministic, learnable synthetic token stream whose global batch is the same in every layout.

Each sequence follows a fixed affine successor rule next = (a * token + b) mod V (a bigram
table the model can learn, so the loss falls), restarted at a random token at position 0 and at
10% of positions. Between restarts token t = A_j * start + B_j (mod V) with j steps since the
restart, A_j = a^j, B_j = b (a^(j-1) + ... + 1), so a whole batch is built without a Python loop
over positions. The global batch of step `step` comes from a CPU generator seeded by
(seed, step); data-parallel rank d takes rows [d*G/dp, (d+1)*G/dp). Every layout sees the same
tokens, so losses are comparable.

With `launch --data` the global batch is cut from a token file instead (plan3d.run.tokens
`global_windows`: windows at offsets drawn from (seed, step) alone), chunked over dp the same way.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from plan3d.run.tokens import global_windows

RESTART_FRACTION = 0.1


def _rule(seed: int, vocab: int) -> tuple[int, int]:
    gen = torch.Generator().manual_seed(seed)
    a = int(torch.randint(2, max(3, vocab), (1,), generator=gen))
    b = int(torch.randint(1, max(2, vocab), (1,), generator=gen))
    return a, b


@lru_cache(maxsize=8)
def _powers(a: int, b: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_j, B_j for j < length (x_j = A_j x_0 + B_j mod V)."""
    mul, add = [1], [0]
    for _ in range(length - 1):
        mul.append(mul[-1] * a % vocab)
        add.append((add[-1] * a + b) % vocab)
    return torch.tensor(mul), torch.tensor(add)


def global_batch(seed: int, step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """[batch, seq + 1] tokens of step `step` (inputs = [:, :-1], targets = [:, 1:])."""
    length = seq + 1
    gen = torch.Generator().manual_seed(seed * 7919 + step + 1)
    restart = torch.rand(batch, length, generator=gen) < RESTART_FRACTION
    restart[:, 0] = True
    starts = torch.randint(vocab, (batch, length), generator=gen)
    position = torch.arange(length).expand(batch, length)
    last = torch.where(restart, position, torch.zeros_like(position)).cummax(dim=1).values
    mul, add = _powers(*_rule(seed, vocab), length, vocab)
    since = position - last
    return (mul[since] * starts.gather(1, last) + add[since]) % vocab


def replica_batch(seed: int, step: int, batch: int, seq: int, vocab: int, dp: int, dp_rank: int, tokens=None):
    """(inputs, targets) of this data-parallel replica: from the token file `tokens` (a numpy
    array, `launch --data`) when given, else from the synthetic stream."""
    full = (global_batch(seed, step, batch, seq, vocab) if tokens is None
            else torch.from_numpy(global_windows(tokens, seed, step, batch, seq)))
    rows = full.chunk(dp)[dp_rank]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
