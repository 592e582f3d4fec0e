"""Mixture-of-experts MLP with expert parallelism over all-to-all (dropless token routing).

The layer (`MoE`): a router (h x E linear, replicated over tp), scores by softmax (Shazeer et al.
2017, arXiv:1701.06538; Mixtral, Jiang et al. 2024, arXiv:2401.04088) or sigmoid (DeepSeek-V3,
arXiv:2412.19437, section 2.1.2), each token's top_k experts with their scores renormalised to sum
to one; every routed token is computed (dropless, as Megatron-Core's `moe_token_dispatcher_type
alltoall` without a capacity factor). Each expert is an FFN of the model's activation (GELU or
SwiGLU) and bias setting; optional shared experts every token passes through (DeepSeekMoE, Dai
et al. 2024, arXiv:2401.06066), scaled by a sigmoid gate h -> 1 for Qwen2-MoE. No load-balancing
auxiliary loss is added: it is computed per micro-batch and per rank in Megatron, so it would
differ between layouts (and from one process); the runtime trains the plain language-model loss.

Expert parallelism (GShard, Lepikhin et al. 2020, arXiv:2006.16668): the ep ranks of a group each
hold experts/ep consecutive experts; their tokens differ (ep is folded out of dp x cp, Megatron-
Core's convention, `plan3d/rankmap.py`). A rank sorts its (token, choice) pairs by expert, sends
each ep rank the rows of its experts with `all_to_all_single` (uneven splits; gloo supports it
on CPU, checked on torch 2.13), computes its experts on what it received, and sends the outputs
back the same way; the backward of each all-to-all is the all-to-all with the splits swapped, so
forward and backward are exact.

Tensor parallelism (expert tensor parallel = tp): the MoE layer is a tp-REPLICATED region: every
tp rank routes the same (full) tokens, an expert's up/gate weights are column slices and its down
weight a row slice, and the experts' partial outputs are all-reduced over tp before the expert's
down bias is added (Megatron's column/row pair with its `f`/`g` operators). Under sequence
parallelism the sequence shards are all-gathered on the way in and this rank's shard is taken on
the way out (`tp.gather_replicated`/`shard_replicated`). The router, the down biases and the shared
gate therefore get whole gradients on every tp rank (`tp_full_grad`: not summed over tp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from plan3d.runtime import tp as tpx
from plan3d.runtime.layers import ColLinear, RowLinear, make_param
from plan3d.specs.model import ModelSpec


@dataclass(frozen=True)
class EPInfo:
    """This rank's expert-parallel facts; `group` is None when ep == 1."""

    size: int = 1
    rank: int = 0
    group: object | None = None


def _mark(module: nn.Module, **flags) -> nn.Module:
    for p in module.parameters():
        for key, value in flags.items():
            setattr(p, key, value)
    return module


def _activation(model: ModelSpec):
    return {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "swiglu": F.silu}[model.activation]


# ---- routing -------------------------------------------------------------------------------------
def route(logits: torch.Tensor, top_k: int, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of router logits [T, E]: softmax or sigmoid scores in
    fp32, the top_k, renormalised to sum to 1 per token."""
    scores = logits.float().softmax(dim=-1) if score == "softmax" else logits.float().sigmoid()
    top, ids = scores.topk(top_k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), ids


# ---- all-to-all with its exact backward ----------------------------------------------------------
def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(Function):
    """Rows [sum(send), ...] -> rows [sum(recv), ...]: send[i] rows to ep rank i, recv[i] from it."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], ep: EPInfo) -> torch.Tensor:
    return x if ep.size == 1 else _AllToAll.apply(x, send, recv, ep.group)


def exchange_counts(counts: torch.Tensor, ep: EPInfo) -> torch.Tensor:
    """counts [E] of this rank's rows per expert -> [ep, E/ep]: row s = what ep rank s sends to
    each of this rank's experts."""
    local = counts.numel() // ep.size
    if ep.size == 1:
        return counts.view(1, local)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=ep.group)
    return out.view(ep.size, local)


@dataclass
class Dispatch:
    """The bookkeeping of one layer's token exchange (no tensors that need gradients)."""

    order: torch.Tensor  # this rank's (token, choice) pairs sorted by expert
    send: list[int]  # rows to each ep rank
    recv: list[int]  # rows from each ep rank
    by_expert: torch.Tensor  # received rows sorted by local expert
    per_expert: list[int]  # received rows per local expert


def plan_dispatch(ids: torch.Tensor, experts: int, ep: EPInfo) -> Dispatch:
    """Where each (token, choice) pair of `ids` [T, k] goes, and how the received rows group."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    local = experts // ep.size
    received = exchange_counts(counts, ep)  # [ep, local]
    local_ids = torch.repeat_interleave(torch.arange(local, device=ids.device).repeat(ep.size), received.reshape(-1))
    by_expert = torch.argsort(local_ids, stable=True)
    return Dispatch(order, counts.view(ep.size, local).sum(1).tolist(), received.sum(1).tolist(), by_expert,
                    received.sum(0).tolist())


# ---- the experts -----------------------------------------------------------------------------------
class Expert(nn.Module):
    """One routed expert's FFN, tp-split: up (and gate) column slices with their biases, the down
    row slice. `partial`: this tp rank's share of the output; the forward sums the shares over tp
    and adds the down bias (call the module: FSDP2 gathers a sharded expert in its forward hook)."""

    def __init__(self, model: ModelSpec, width: int, tp: tpx.TPInfo):
        super().__init__()
        self.tp = tp
        self.act, self.swiglu = _activation(model), model.activation == "swiglu"
        self.up = ColLinear(model.hidden, width, tp, model.bias)
        self.gate = ColLinear(model.hidden, width, tp, model.bias) if self.swiglu else None
        self.down = nn.Module()
        self.down.weight = make_param(model.hidden, width // tp.size, tp_dim=1, kind="proj")
        self.down.bias = make_param(model.hidden, tp_dim=None, kind="zeros") if model.bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.gate(x)) * self.up(x) if self.swiglu else self.act(self.up(x))
        return F.linear(hidden, self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tpx.exit_(self.partial(x), self.tp)
        return out if self.down.bias is None else out + self.down.bias


class SharedExperts(nn.Module):
    """The shared experts as one FFN of `shared_ffn_hidden` (tp-split like the dense MLP), with
    the optional sigmoid gate (Qwen2-MoE `shared_expert_gate`)."""

    def __init__(self, model: ModelSpec, tp: tpx.TPInfo):
        super().__init__()
        width, self.tp = model.moe.shared_ffn_hidden, tp
        self.act, self.swiglu = _activation(model), model.activation == "swiglu"
        self.up = ColLinear(model.hidden, width, tp, model.bias)
        self.gate = ColLinear(model.hidden, width, tp, model.bias) if self.swiglu else None
        self.down = _mark(RowLinear(width, model.hidden, tp, model.bias), tp_full_grad=True)
        self.scale = None
        if model.moe.shared_expert_gate:
            self.scale = nn.Module()
            self.scale.weight = make_param(1, model.hidden, tp_dim=None, kind="normal")
            self.scale.weight.tp_full_grad = True

    def forward(self, x):
        entered = tpx.enter(x, self.tp)
        hidden = self.act(self.gate(entered)) * self.up(entered) if self.swiglu else self.act(self.up(entered))
        out = self.down(hidden)
        return out if self.scale is None else out * torch.sigmoid(F.linear(x, self.scale.weight))


class MoE(nn.Module):
    """The MoE MLP of one layer: x [b, s (s/tp with SP), h] -> same. Experts are named by their
    GLOBAL index (`experts.5.up.weight`), so names and initial values do not depend on ep."""

    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, ep: EPInfo = EPInfo()):
        super().__init__()
        moe = model.moe
        self.outer_tp, self.tp, self.ep = tp, tpx.without_sequence_parallel(tp), ep
        self.n_experts, self.top_k, self.score = moe.experts, moe.top_k, moe.router
        self.router = nn.Module()
        self.router.weight = make_param(moe.experts, model.hidden, tp_dim=None, kind="normal")
        self.router.bias = make_param(moe.experts, tp_dim=None, kind="zeros") if model.bias else None
        _mark(self.router, tp_full_grad=True)
        width, local = moe.expert_ffn_hidden or model.ffn_hidden_, moe.experts // ep.size
        first = ep.rank * local
        self.experts = nn.ModuleDict({str(e): _mark(Expert(model, width, self.tp), expert=True)
                                      for e in range(first, first + local)})
        for expert in self.experts.values():
            if expert.down.bias is not None:
                expert.down.bias.tp_full_grad = True
        self.shared = SharedExperts(model, self.tp) if moe.shared_ffn_hidden else None

    def forward(self, x):
        full = tpx.gather_replicated(x, self.outer_tp)
        b, s, h = full.shape
        tokens = full.reshape(b * s, h)
        weights, ids = route(F.linear(tokens, self.router.weight, self.router.bias), self.top_k, self.score)
        out = self._routed(tokens, weights.to(tokens.dtype), ids)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return tpx.shard_replicated(out.view(b, s, h), self.outer_tp)

    def _routed(self, tokens, weights, ids):
        """Sum over each token's top_k experts of weight x expert output, experts on their ep ranks."""
        plan = plan_dispatch(ids, self.n_experts, self.ep)
        rows = tokens[plan.order // self.top_k]  # (token, choice) pairs sorted by expert
        received = all_to_all(rows, plan.send, plan.recv, self.ep)
        outputs = self._experts(received[plan.by_expert], plan)
        back = all_to_all(outputs[torch.argsort(plan.by_expert)], plan.recv, plan.send, self.ep)
        pairs = back[torch.argsort(plan.order)].view(*ids.shape, -1)
        return (pairs * weights.unsqueeze(-1)).sum(dim=1)

    def _experts(self, rows, plan: Dispatch):
        """Rows sorted by local expert -> their expert outputs (each expert's tp partial sums
        all-reduced, its bias added)."""
        entered = tpx.enter(rows, self.tp)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), entered.split(plan.per_expert))])
