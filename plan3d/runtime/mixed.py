"""bf16 mixed precision for ZeRO 0, 1 and 2 (Micikevicius et al. 2018, arXiv:1710.03740; the
layout of Megatron-LM's distributed optimizer).

Parameters are bf16 (2 bytes). Each backward adds the bf16 gradient into an fp32 main-gradient
buffer (a post-accumulate hook; 4 bytes) and frees it. The fp32 master weights and the Adam
moments (4 + 8 bytes) exist only for this rank's slice: all of it under ZeRO 0, 1/dp under
ZeRO 1 and 2. ZeRO 2 reduce-scatters the main gradients and keeps only its 1/dp slice. After the
update the master slices are all-gathered and cast into the bf16 parameters. Totals per
parameter: 2 + 4 + 12 = 18 bytes without ZeRO, the figure of the memory model.
ZeRO 3 uses FSDP2's MixedPrecisionPolicy instead (dp.shard_stages).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from plan3d.runtime.comm import all_gather_flat, reduce_scatter_flat
from torch import nn

from plan3d.runtime.dp import _state_bytes, make_optimizer, reduce_model_parallel_grads


class MixedPrecisionDP:
    def __init__(self, entries, ctx, optimizer: str, lr: float, zero: int, dtype: torch.dtype, grad_divisor: int):
        self.entries, self.ctx, self.zero, self.grad_divisor = entries, ctx, zero, grad_divisor
        self.dp, self.dp_rank, self.dp_group = ctx.sizes["dp"], ctx.local("dp"), ctx.group("dp")
        self.slices = self.dp if zero in (1, 2) else 1
        sizes = [e.param.numel() for e in entries]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.slice_numel = -(-sum(sizes) // self.slices)
        self.lo = (self.dp_rank if self.slices > 1 else 0) * self.slice_numel
        full = self._flat(lambda e: e.param.detach())
        counted = self._flat(lambda e: torch.full((e.param.numel(),), float(e.counted)))
        self.counted_slice = counted.narrow(0, self.lo, self.slice_numel).clone()
        self.master = nn.Parameter(full.narrow(0, self.lo, self.slice_numel).clone())
        self.opt = make_optimizer([self.master], optimizer, lr)
        for e in entries:
            e.param.data = e.param.data.to(dtype)
            e.param.register_post_accumulate_grad_hook(self._accumulate)
        self.main_grad: torch.Tensor | None = None
        self._index = {id(e.param): i for i, e in enumerate(entries)}

    def _flat(self, value) -> torch.Tensor:
        flat = torch.zeros(self.slice_numel * self.slices, device=self.ctx.device)
        for e, offset in zip(self.entries, self.offsets):
            flat[offset:offset + e.param.numel()] = value(e).reshape(-1).float()
        return flat

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        e = self.entries[i]
        return flat[self.offsets[i]:self.offsets[i] + e.param.numel()].view(e.param.shape)

    def _accumulate(self, param: torch.Tensor) -> None:
        if self.main_grad is None:
            self.main_grad = torch.zeros(self.slice_numel * self.slices, device=self.ctx.device)
        self._view(self.main_grad, self._index[id(param)]).add_(param.grad.float())
        param.grad = None

    def reduce_grads(self) -> None:
        if self.main_grad is None:
            self.main_grad = torch.zeros(self.slice_numel * self.slices, device=self.ctx.device)
        grad = self.main_grad.div_(self.grad_divisor)
        position = {id(e): i for i, e in enumerate(self.entries)}
        reduce_model_parallel_grads(self.entries, self.ctx, lambda e: self._view(grad, position[id(e)]))
        if self.zero == 2 and self.dp > 1:
            mine = torch.empty(self.slice_numel, device=self.ctx.device)
            reduce_scatter_flat(mine, grad, group=self.dp_group)
            self.main_grad, self.master.grad = None, mine.div_(self.dp)
            return
        if self.dp > 1:
            dist.all_reduce(grad, group=self.dp_group)
            grad.div_(self.dp)
        self.master.grad = grad.narrow(0, self.lo, self.slice_numel)

    def grad_sq_sum(self) -> torch.Tensor:
        if self.slices == 1 and self.dp_rank != 0:
            return torch.zeros((), device=self.ctx.device)
        return (self.master.grad.pow(2) * self.counted_slice).sum()

    def scale_grads(self, coef: float) -> None:
        self.master.grad.mul_(coef)

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        if self.slices == 1:
            return mine.detach()
        full = torch.empty(self.slice_numel * self.slices, device=self.ctx.device)
        all_gather_flat(full, mine.detach().contiguous(), group=self.dp_group)
        return full

    def step(self) -> None:
        self.opt.step()
        full = self._gather(self.master)
        with torch.no_grad():
            for i, e in enumerate(self.entries):
                e.param.copy_(self._view(full, i))

    def zero_grad(self) -> None:
        self.main_grad, self.master.grad = None, None
        for e in self.entries:
            e.param.grad = None

    def state_bytes(self) -> dict[str, int]:
        grads = self.main_grad if self.main_grad is not None else self.master.grad
        return {"weights": sum(e.param.numel() * e.param.element_size() for e in self.entries),
                "gradients": 0 if grads is None else grads.numel() * grads.element_size(),
                "optimizer": self.master.numel() * self.master.element_size() + _state_bytes(self.opt)}

    def moment_names(self) -> tuple[str, ...]:
        return () if isinstance(self.opt, torch.optim.SGD) else ("exp_avg", "exp_avg_sq")

    def logical_state(self):
        """fp32 master and moments per parameter (checkpoints do not depend on the precision)."""
        state = self.opt.state.get(self.master, {})
        fulls = {"param": self._gather(self.master),
                 **{k: self._gather(state[k]) for k in self.moment_names() if k in state}}
        return {e.name: {k: self._view(v, i) for k, v in fulls.items()} for i, e in enumerate(self.entries)}

    def load_logical_state(self, tensors, step: int) -> None:
        with torch.no_grad():
            fulls = {k: self._flat(lambda e, k=k: tensors[e.name][k]) for k in ("param",) + self.moment_names()}
            self.master.copy_(fulls["param"].narrow(0, self.lo, self.slice_numel))
            for i, e in enumerate(self.entries):
                e.param.copy_(self._view(fulls["param"], i))
            moments = {k: fulls[k].narrow(0, self.lo, self.slice_numel).clone() for k in self.moment_names()}
            if moments:
                self.opt.state[self.master] = {"step": torch.tensor(float(step)), **moments}
