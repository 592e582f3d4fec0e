"""Layout values as float arrays, so one formula serves one layout and 10^5 layouts alike."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan3d.specs import schedule as schedules
from plan3d.vocab import RECOMPUTE_CODES  # noqa: F401  (re-exported: the codes of `recompute` below)


@dataclass(frozen=True)
class LayoutArrays:
    """Broadcastable float arrays of layout values; `m` = micro-batches per pipeline per step."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    mb: np.ndarray
    vpp: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray  # plan3d.vocab.RECOMPUTE_CODES (the position in RECOMPUTE_MODES)
    sp: np.ndarray  # 1.0 with sequence parallelism
    m: np.ndarray
    cp: np.ndarray | float = 1.0  # context parallel degree: each rank holds seq / cp tokens of a sequence
    ep: np.ndarray | float = 1.0  # expert parallel degree: MoE layers split their experts over ep of the dp*cp ranks
    etp: np.ndarray | None = None  # expert tensor-parallel degree (None: tp; MoE Parallel Folding)
    schedule: np.ndarray | None = None  # pipeline schedule codes (plan3d.specs.schedule; None: the default for vpp)

    @property
    def schedule_codes(self) -> np.ndarray:
        """Each row's schedule code: its own, or 1F1B / interleaved 1F1B by vpp."""
        return schedules.default_codes(self.vpp) if self.schedule is None else self.schedule.astype(np.int64)

    @property
    def v_shape(self) -> np.ndarray:
        """True where the schedule places stages r and 2 pp - 1 - r on rank r (ZBV, DualPipeV)."""
        return schedules.column("v_shape", self.schedule_codes)

    @property
    def last_rank(self) -> np.ndarray:
        """The pipeline rank holding the last stage (the output layer and the loss): pp - 1, or 0
        under a V-shaped schedule."""
        return np.where(self.v_shape, 0.0, self.pp - 1)

    @property
    def expert_tp(self) -> np.ndarray:
        """The experts' tensor-parallel degree: etp, or tp where the layout does not set it."""
        return self.tp if self.etp is None else self.etp

    @property
    def sp_div(self) -> np.ndarray:
        """What sequence parallelism divides the replicated activations by: tp with it, else 1."""
        return np.where(self.sp > 0, self.tp, 1.0)

    @property
    def mb_share(self) -> np.ndarray:
        """A micro-batch's sequences one rank holds, counted in whole sequences: mb / cp (context
        parallelism splits every sequence into cp equal shares; Megatron-Core
        `get_batch_on_this_cp_rank`). Every per-token count of the cost model is this times seq."""
        return self.mb / self.cp

    @property
    def grad_ranks(self) -> np.ndarray:
        """Ranks a gradient is reduced (and ZeRO-sharded) over: dp * cp. Megatron-Core reduces
        over its dp_cp group (DistributedDataParallel.dp_cp_group) and shards the distributed
        optimizer over it; torchtitan's FSDP mesh is dp_shard_cp."""
        return self.dp * self.cp

    @property
    def expert_grad_ranks(self) -> np.ndarray:
        """Ranks an expert's gradient is reduced (and ZeRO-sharded) over: the expert-data-parallel
        group, tp * cp * dp / (ep * etp), i.e. dp * cp / ep at etp = tp (Megatron-Core folds the
        expert grid out of a stage's ranks: parallel_state's expert_data_parallel group;
        `plan3d.rankmap` builds it as `edp`)."""
        return self.tp * self.cp * self.dp / (self.ep * self.expert_tp)


def layout_arrays(global_batch: int, tp, pp, dp, mb, vpp, zero, recompute, sp, cp=1, ep=1, etp=None,
                  schedule=None) -> LayoutArrays:
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    m = global_batch // (np.asarray(mb, dtype=np.int64) * np.asarray(dp, dtype=np.int64))
    return LayoutArrays(f(tp), f(pp), f(dp), f(mb), f(vpp), f(zero), f(recompute), f(sp), f(m), f(cp), f(ep),
                        None if etp is None else f(etp), None if schedule is None else np.asarray(schedule))
