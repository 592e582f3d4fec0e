"""Pipeline schedules: the step time of a schedule (plan3d.specs.schedule) from per-stage times.

Narayanan et al. 2021 (SC'21, section 2.2): with m micro-batches, p stages and a per-micro-batch
forward + backward time t on every stage, 1F1B takes (m + p - 1) t and interleaving over v chunks
shrinks the bubble (p - 1) t to (p - 1) t / v. With unequal stages (t_r) the slowest stage paces
the steady state and the others only fill and drain the pipe:
    step = m * max_r t_r + (sum_r t_r - max_r t_r) / v,
which is (m + p - 1) t for equal stages. The zero-bubble family fills part of the fill and drain
with deferred weight-gradient work W: each stage's share becomes scale * (t_r - c W_r), with c
and scale from the schedule table (ZB-H1 c = 2, ZB-V c = 3, DualPipe(V) c = 1; DualPipe's
bidirectional pipe halves it).
"""
from __future__ import annotations

import numpy as np


def masked_max(values, weights):
    """Maximum over axis 0 of the entries with positive weight (stage-kind stacks may carry
    a placeholder with weight 0)."""
    return np.max(np.where(weights > 0, values, -np.inf), axis=0)


def masked_argmax(values, weights):
    return np.argmax(np.where(weights > 0, values, -np.inf), axis=0)


def pipeline_s(stage_s, weights, m, vpp, core_share=1.0, weight_grad_s=0.0, bubble=(1.0, 0.0)):
    """Step time of the pipeline and its bubble; `stage_s` has stages (or stage kinds with
    multiplicities `weights`) on axis 0.

    `core_share` < 1: ranks share fewer CPU cores than there are ranks, and `stage_s` was timed
    with every rank busy (each at `core_share` of a core). The scheduler is work-conserving: a
    rank idle in the bubble (a fraction b of the step) hands its core to busy ones, which then run
    at 1 / (1 - b) of that speed, up to a whole core. The step shrinks by max(core_share, 1 - b):
    with enough ranks per core the bubble costs nothing, since m * slowest is the busy time.

    `weight_grad_s`: each stage's weight-gradient time per micro-batch; `bubble`: the schedule's
    (scale, weight-gradient multiple) per row (`plan3d.specs.schedule.bubble_weights`)."""
    scale, grads = bubble
    slowest = masked_max(stage_s, weights)
    unit = np.maximum(stage_s - grads * weight_grad_s, 0.0)
    slow_unit = np.take_along_axis(np.broadcast_to(unit, np.shape(stage_s)), masked_argmax(stage_s, weights)[None], 0)[0]
    fill_drain = scale * (np.sum(weights * unit, axis=0) - slow_unit) / vpp
    total = m * slowest + fill_drain
    busy = np.divide(m * slowest, total, out=np.ones_like(np.asarray(total, dtype=float)), where=total > 0)
    total = total * np.maximum(core_share, busy)
    return total, np.maximum(total - m * slowest, 0.0)
