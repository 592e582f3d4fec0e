"""Data parallelism with ZeRO stages 0-3 (Rajbhandari et al. 2020, arXiv:1910.02054).

- ZeRO 0 (fp32): `ReplicatedDP`: every dp rank holds weights, gradients and Adam states;
  gradients all-reduced (mean) in one flat bucket.
- ZeRO 1 and 2, and every bf16 ZeRO 0-2: `zero.FlatZeroDP`, one flat buffer with a per-dp-rank
  fp32 master slice (hand-written).
- ZeRO 3: `FullyShardedDP`, FSDP2 `fully_shard` over the dp mesh (torch-native), per block and
  per stage (`shard_stages`).

Hand-written for 0-2 because DDP crashes or gives WRONG losses under the pipelining schedules and
rejects tensor-parallel parameters, and `ZeroRedundancyOptimizer` has no ZeRO 2 (torch-notes.md).
With context parallelism "dp" below is the dp x cp group (`ParallelContext.dp_cp_size`,
Megatron's data-parallel group with context parallel; `runtime/cp.py`); a routed expert's
parameters are reduced and sharded over the expert-data-parallel group instead (`SplitDP`).
Model-parallel gradient reductions (sequence-parallel replicas over tp, tied embedding copies
over the embedding group) happen first, in `engine.reduce_model_parallel_grads`. Every engine
satisfies `engine.DataParallel`; `make_dp` picks one.
"""
from __future__ import annotations

import torch
from torch import nn

from plan3d.runtime.comm import all_reduce_coalesced
from plan3d.runtime.context import ParallelContext, Replicas
from plan3d.runtime.engine import DataParallel, Entry, LogicalState, local_tensor, reduce_model_parallel_grads
from plan3d.runtime.optim import make_optimizer, moment_names, optimizer_state_bytes
from plan3d.runtime.zero import FlatZeroDP


class ReplicatedDP:
    """ZeRO 0 in fp32 (and the base of FullyShardedDP): per-parameter gradients in `param.grad`."""

    collects_grads = False

    def __init__(self, entries: list[Entry], ctx: ParallelContext, optimizer: str, lr: float,
                 replicas: Replicas | None = None):
        self.entries, self.ctx = entries, ctx
        replicas = replicas or ctx.replicas()  # dp x cp (runtime/cp.py); the edp group for experts
        self.dp, self.dp_rank, self.dp_group, self.divisor = replicas.size, replicas.rank, replicas.group, replicas.divisor
        self.opt = make_optimizer([e.param for e in entries], optimizer, lr)

    def reduce_grads(self) -> None:
        reduce_model_parallel_grads(self.entries, self.ctx)
        grads = [e.param.grad for e in self.entries if e.param.grad is not None]
        if self.dp > 1 and grads:
            all_reduce_coalesced(grads, self.dp_group)
        if self.divisor > 1:
            for g in grads:
                g.div_(self.divisor)

    def _counted_sq_sum(self) -> torch.Tensor:
        total = torch.zeros((), device=self.ctx.device)
        for e in self.entries:
            if e.counted and e.param.grad is not None:
                total += local_tensor(e.param.grad).float().pow(2).sum()
        return total

    def grad_sq_sum(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (dp replicas: dp rank 0 counts)."""
        return self._counted_sq_sum() if self.dp_rank == 0 else torch.zeros((), device=self.ctx.device)

    def scale_grads(self, coef: float) -> None:
        for e in self.entries:
            if e.param.grad is not None:
                e.param.grad.mul_(coef)

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        for e in self.entries:
            e.param.grad = None

    def state_bytes(self) -> dict[str, int]:
        params = [local_tensor(e.param) for e in self.entries]
        grads = [local_tensor(e.param.grad) for e in self.entries if e.param.grad is not None]
        return {"weights": sum(p.numel() * p.element_size() for p in params),
                "gradients": sum(g.numel() * g.element_size() for g in grads),
                "optimizer": optimizer_state_bytes(self.opt)}

    def moment_names(self) -> tuple[str, ...]:
        return moment_names(self.opt)

    # ---- checkpoint: per-parameter tensors, full over dp, this rank's tp slice ----------------
    def logical_state(self) -> LogicalState:
        out = {}
        for e in self.entries:
            state = self.opt.state.get(e.param, {})
            out[e.name] = {"param": e.param.detach(), **{k: v for k, v in state.items() if k != "step"}}
        return out

    def load_logical_state(self, tensors: LogicalState, step: int) -> None:
        with torch.no_grad():
            for e in self.entries:
                e.param.copy_(tensors[e.name]["param"])
                moments = {k: v.clone() for k, v in tensors[e.name].items() if k != "param"}
                if moments:
                    self.opt.state[e.param] = {"step": torch.tensor(float(step)), **moments}


class FullyShardedDP(ReplicatedDP):
    """ZeRO 3 through FSDP2 (`fully_shard` applied by `shard_stages`); FSDP reduce-scatters
    (mean over dp) during backward, so only the model-parallel reductions remain here."""

    def reduce_grads(self) -> None:
        reduce_model_parallel_grads(self.entries, self.ctx)

    def grad_sq_sum(self) -> torch.Tensor:
        """Every rank holds a distinct 1/dp shard: each counts its own."""
        return self._counted_sq_sum()

    def logical_state(self) -> LogicalState:
        out = {}
        for e in self.entries:
            state = self.opt.state.get(e.param, {})
            out[e.name] = {k: v.full_tensor() for k, v in {"param": e.param.detach(), **state}.items() if k != "step"}
        return out

    def _my_chunk(self, full: torch.Tensor, e: Entry) -> torch.Tensor:
        """This rank's FSDP2 shard (dim 0) of a full tensor: over dp x cp, or over the
        expert-data-parallel group for a routed expert's parameter under ep > 1 (`shard_stages`)."""
        replicas = self.ctx.replicas(expert=sharded_by_experts(e, self.ctx))
        return full.chunk(replicas.size, dim=0)[replicas.rank]

    def load_logical_state(self, tensors: LogicalState, step: int) -> None:
        with torch.no_grad():
            for e in self.entries:
                local_tensor(e.param).copy_(self._my_chunk(tensors[e.name]["param"], e))
                moments = {}
                for k in self.moment_names():
                    moment = torch.zeros_like(e.param)
                    local_tensor(moment).copy_(self._my_chunk(tensors[e.name][k], e))
                    moments[k] = moment
                if moments:
                    self.opt.state[e.param] = {"step": torch.tensor(float(step)), **moments}


def sharded_by_experts(e: Entry, ctx: ParallelContext) -> bool:
    """Whether ZeRO 3 shards this parameter over the expert-data-parallel group (a routed
    expert's under ep > 1; with ep = 1 the experts are sharded with their block over dp x cp)."""
    return e.expert and ctx.ep.size > 1


def _shard_expert(expert: nn.Module, ctx: ParallelContext, mp) -> None:
    """One routed expert as an FSDP2 unit over the edp mesh; gradients summed, divided by dp x cp."""
    from torch.distributed.fsdp import fully_shard

    edp = ctx.expert_mesh["edp"]
    fully_shard(expert, mesh=edp, mp_policy=mp)
    expert.set_gradient_divide_factor(float(ctx.dp_cp_size))
    if edp.size() > 1:
        # a plain sum, then the division: gloo has no PREMUL_SUM. Not on a 1-rank mesh: there torch
        # 2.13 (`_fsdp_collectives.foreach_reduce`) divides by the factor twice with it.
        expert.set_force_sum_reduction_for_comms(True)


def shard_stages(stages: list[nn.Module], ctx: ParallelContext, amp_dtype) -> None:
    """FSDP2: one unit per transformer block and one per stage (torchtitan's composition).
    Under ep > 1 each routed expert is first its own unit over the expert-data-parallel mesh,
    its gradient reduce-scattered as a sum and divided by dp x cp (the batch's replicas), as
    torchtitan 0.3 shards experts over its `dp_shard_mod_ep` mesh with a gradient divide factor."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # imports DTensor: ZeRO 3 only

    mesh = ctx.dp_cp_mesh  # dp x cp, as torchtitan folds cp into its FSDP mesh
    mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32) if amp_dtype else MixedPrecisionPolicy()
    for stage in stages:
        for block in stage.layers.values():
            if block.routed and ctx.ep.size > 1:
                for expert in block.mlp.experts.values():
                    _shard_expert(expert, ctx, mp)
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(stage, mesh=mesh, mp_policy=mp)


class SplitDP:
    """Dense parameters and routed experts in two engines of the same kind: the dense one over
    dp x cp, the experts' over the expert-data-parallel group (Megatron-Core keeps expert
    parameters in their own buffers, reduced over the expert-data-parallel group). One rank's
    optimizer update is the same element by element as a single engine's."""

    def __init__(self, dense: DataParallel, experts: DataParallel):
        self.dense, self.experts = dense, experts
        self.parts = (dense, experts)
        self.entries = dense.entries + experts.entries
        self.collects_grads = dense.collects_grads

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def reduce_grads(self) -> None:
        for part in self.parts:
            part.reduce_grads()

    def grad_sq_sum(self) -> torch.Tensor:
        return self.dense.grad_sq_sum() + self.experts.grad_sq_sum()

    def scale_grads(self, coef: float) -> None:
        for part in self.parts:
            part.scale_grads(coef)

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def state_bytes(self) -> dict[str, int]:
        dense, experts = self.dense.state_bytes(), self.experts.state_bytes()
        return {k: dense[k] + experts[k] for k in dense}

    def moment_names(self) -> tuple[str, ...]:
        return self.dense.moment_names()

    def logical_state(self) -> LogicalState:
        return {**self.dense.logical_state(), **self.experts.logical_state()}

    def load_logical_state(self, tensors: LogicalState, step: int) -> None:
        for part in self.parts:
            part.load_logical_state(tensors, step)


def make_dp(entries: list[Entry], ctx: ParallelContext, zero: int, optimizer: str, lr: float,
            param_dtype: torch.dtype | None = None, pipeline_micro_batches: int = 1) -> DataParallel:
    """The engine for ZeRO stage `zero`: FSDP2 for 3; the flat buffer for 1 and 2 over dp > 1 and
    for every bf16/fp16 run (`param_dtype`); per-parameter replication otherwise. Routed experts
    (ZeRO 0-2) get an engine of the same kind over their expert-data-parallel group (`SplitDP`).
    `pipeline_micro_batches`: micro-batch gradients the pipeline schedule sums (1 without one);
    an engine that `collects_grads` divides by it, the schedule must then not scale."""
    if zero == 3:
        return FullyShardedDP(entries, ctx, optimizer, lr)
    flat = param_dtype is not None or (zero in (1, 2) and ctx.dp_cp_size > 1)

    def engine(part: list[Entry], replicas: Replicas) -> DataParallel:
        if flat:
            return FlatZeroDP(part, ctx, optimizer, lr, zero, param_dtype or torch.float32,
                              grad_divisor=pipeline_micro_batches, replicas=replicas)
        return ReplicatedDP(part, ctx, optimizer, lr, replicas)

    experts = [e for e in entries if e.expert]
    dense = engine([e for e in entries if not e.expert], ctx.replicas())
    return SplitDP(dense, engine(experts, ctx.replicas(expert=True))) if experts else dense
