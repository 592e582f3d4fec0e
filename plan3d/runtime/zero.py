"""ZeRO 1 and 2 over one flat buffer, in fp32 or with bf16/fp16 parameters (Rajbhandari et al.
2020, arXiv:1910.02054; mixed precision after Micikevicius et al. 2018, arXiv:1710.03740).

The layout of Megatron-LM's distributed optimizer (megatron-core 0.19.2:
`distributed/distributed_data_parallel.py` adds each `param.grad` into an fp32 `main_grad` in a
backward hook and frees it; `distributed/param_and_grad_buffer.py` all-gathers the updated
parameters in the parameter dtype):

- every parameter of the rank is a view into one flat, padded parameter buffer;
- each backward adds the gradient into an fp32 main-gradient buffer of the same layout (a
  post-accumulate hook) and frees `param.grad`;
- the buffer is cut into `slices` equal slices (dp under ZeRO 1 and 2, one otherwise); this rank
  keeps the fp32 master weights and the Adam moments of its slice only. With fp32 parameters the
  master IS the slice of the parameter buffer (no copy: 4 + 4 + 8 bytes a parameter); with
  bf16/fp16 parameters it is an fp32 copy (2 + 4 + 4 + 8 = 18 bytes without ZeRO, the figure of
  the memory model);
- ZeRO 1 all-reduces the main gradients, ZeRO 2 reduce-scatters them and keeps its slice;
- after the update the master slices are cast to the parameter dtype and all-gathered into the
  parameter buffer.

fp32 ZeRO 0 stays per-parameter (`dp.ReplicatedDP`); bf16 ZeRO 0 is this class with one slice.
ZeRO 3 is FSDP2 (`dp.FullyShardedDP`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plan3d.runtime.comm import all_gather_flat, reduce_scatter_flat
from plan3d.runtime.context import ParallelContext, Replicas
from plan3d.runtime.engine import Entry, LogicalState, reduce_model_parallel_grads
from plan3d.runtime.optim import make_optimizer, moment_names, optimizer_state_bytes


class FlatZeroDP:
    """ZeRO 1/2 (`zero`) over one flat buffer; `param_dtype` float32 (master = parameters) or
    bfloat16/float16 (fp32 master slice). `grad_divisor`: how many micro-batch gradients the
    pipeline schedule sums unscaled into the main gradients (they are divided here)."""

    collects_grads = True

    def __init__(self, entries: list[Entry], ctx: ParallelContext, optimizer: str, lr: float, zero: int,
                 param_dtype: torch.dtype = torch.float32, grad_divisor: int = 1, replicas: Replicas | None = None):
        self.entries, self.ctx, self.zero, self.grad_divisor = entries, ctx, zero, grad_divisor
        replicas = replicas or ctx.replicas()  # dp x cp (runtime/cp.py); the edp group for experts
        self.dp, self.dp_rank, self.dp_group, self.divisor = replicas.size, replicas.rank, replicas.group, replicas.divisor
        self.slices = self.dp if zero in (1, 2) else 1
        self.offsets, total = {}, 0
        for e in entries:
            self.offsets[e.name], total = total, total + e.param.numel()
        self.slice_numel = -(-total // self.slices)
        self.lo = (self.dp_rank if self.slices > 1 else 0) * self.slice_numel
        values = self._flat(lambda e: e.param.detach())
        self.counted_slice = self._mine(self._flat(lambda e: torch.full((e.param.numel(),), float(e.counted)))).clone()
        self.master_is_param = param_dtype == torch.float32
        self.params = values if self.master_is_param else values.to(param_dtype)
        self.master = nn.Parameter(self._mine(values) if self.master_is_param else self._mine(values).clone())
        self.opt = make_optimizer([self.master], optimizer, lr)
        self._by_param = {id(e.param): e for e in entries}
        for e in entries:
            e.param.data = self.view(self.params, e)
            e.param.register_post_accumulate_grad_hook(self._accumulate)
        self.main_grad: torch.Tensor | None = None

    # ---- the flat layout ---------------------------------------------------------------------
    def _flat(self, value) -> torch.Tensor:
        """An fp32 flat buffer holding `value(entry)` of every entry at its offset."""
        flat = torch.zeros(self.slice_numel * self.slices, device=self.ctx.device)
        for e in self.entries:
            flat[self.offsets[e.name]:self.offsets[e.name] + e.param.numel()] = value(e).reshape(-1).float()
        return flat

    def view(self, flat: torch.Tensor, e: Entry) -> torch.Tensor:
        """Entry `e`'s part of a flat buffer, in its shape."""
        return flat[self.offsets[e.name]:self.offsets[e.name] + e.param.numel()].view(e.param.shape)

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, self.lo, self.slice_numel)

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        """The full fp32 buffer from every rank's slice."""
        if self.slices == 1:
            return mine.detach()
        full = torch.empty(self.slice_numel * self.slices, device=self.ctx.device)
        all_gather_flat(full, mine.detach().contiguous(), group=self.dp_group)
        return full

    # ---- gradients -----------------------------------------------------------------------------
    def _new_main_grad(self) -> torch.Tensor:
        return torch.zeros(self.slice_numel * self.slices, device=self.ctx.device)

    def _accumulate(self, param: torch.Tensor) -> None:
        if self.main_grad is None:
            self.main_grad = self._new_main_grad()
        self.view(self.main_grad, self._by_param[id(param)]).add_(param.grad.float())
        param.grad = None

    def reduce_grads(self) -> None:
        for e in self.entries:  # written to param.grad without autograd's accumulation (and so its hook):
            if e.param.grad is not None:  # torch's split weight backward of the zero-bubble schedules
                self._accumulate(e.param)
        grad = (self.main_grad if self.main_grad is not None else self._new_main_grad()).div_(self.grad_divisor)
        self.main_grad = grad
        reduce_model_parallel_grads(self.entries, self.ctx, lambda e: self.view(grad, e))
        if self.zero == 2 and self.dp > 1:
            mine = torch.empty(self.slice_numel, device=self.ctx.device)
            reduce_scatter_flat(mine, grad, group=self.dp_group)
            self.main_grad, self.master.grad = None, mine.div_(self.divisor)
            return
        if self.dp > 1:
            dist.all_reduce(grad, group=self.dp_group)
        if self.divisor > 1:
            grad.div_(self.divisor)
        self.master.grad = self._mine(grad)

    def grad_sq_sum(self) -> torch.Tensor:
        if self.slices == 1 and self.dp_rank != 0:  # a full replica: dp rank 0 counts it
            return torch.zeros((), device=self.ctx.device)
        return (self.master.grad.pow(2) * self.counted_slice).sum()

    def scale_grads(self, coef: float) -> None:
        self.master.grad.mul_(coef)

    def zero_grad(self) -> None:
        self.main_grad, self.master.grad = None, None
        for e in self.entries:
            e.param.grad = None

    # ---- update ----------------------------------------------------------------------------------
    def step(self) -> None:
        self.opt.step()
        self._publish()

    def _publish(self) -> None:
        """Every rank's updated master slice, in the parameter dtype, into the parameter buffer."""
        mine = self.master.detach().to(self.params.dtype, copy=True)
        if self.slices > 1:
            all_gather_flat(self.params, mine, group=self.dp_group)
        else:
            self.params.copy_(mine)

    def state_bytes(self) -> dict[str, int]:
        grads = self.main_grad if self.main_grad is not None else self.master.grad
        master = 0 if self.master_is_param else self.master.numel() * self.master.element_size()
        return {"weights": self.params.numel() * self.params.element_size(),
                "gradients": 0 if grads is None else grads.numel() * grads.element_size(),
                "optimizer": master + optimizer_state_bytes(self.opt)}

    # ---- checkpoint: fp32 master and moments per parameter (independent of the precision) ------
    def moment_names(self) -> tuple[str, ...]:
        return moment_names(self.opt)

    def logical_state(self) -> LogicalState:
        state = self.opt.state.get(self.master, {})
        fulls = {"param": self._gather(self.master),
                 **{k: self._gather(state[k]) for k in self.moment_names() if k in state}}
        return {e.name: {k: self.view(v, e) for k, v in fulls.items()} for e in self.entries}

    def load_logical_state(self, tensors: LogicalState, step: int) -> None:
        with torch.no_grad():
            fulls = {k: self._flat(lambda e, k=k: tensors[e.name][k]) for k in ("param",) + self.moment_names()}
            self.params.copy_(fulls["param"])
            self.master.copy_(self._mine(fulls["param"]))
            moments = {k: self._mine(fulls[k]).clone() for k in self.moment_names()}
            if moments:
                self.opt.state[self.master] = {"step": torch.tensor(float(step)), **moments}
