"""Tagged parameters and Megatron's column- and row-parallel linear layers (Shoeybi et al. 2019,
arXiv:1909.08053, section 3), shared by the dense model (`runtime/model.py`) and the MoE layer
(`runtime/moe.py`).

Every parameter carries `tp_dim` (the dimension tensor parallelism splits, None: replicated) and
`init_kind` (normal, proj, ones, zeros); MoE parameters also `expert` (a routed expert's: reduced
and ZeRO-sharded over the expert-data-parallel group) and `tp_full_grad` (replicated over tp and
computed in a tp-replicated region: its gradient is already whole on every tp rank, so sequence
parallelism does not sum it over tp).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plan3d.runtime import tp as tpx


def tag_param(param: nn.Parameter, tp_dim: int | None, kind: str) -> nn.Parameter:
    param.tp_dim, param.init_kind = tp_dim, kind
    return param


def make_param(*shape: int, tp_dim: int | None, kind: str) -> nn.Parameter:
    return tag_param(nn.Parameter(torch.empty(*shape)), tp_dim, kind)


class ColLinear(nn.Module):
    """Column-parallel: weight [out/tp, in], bias [out/tp]; input must be `tpx.enter`ed."""

    def __init__(self, d_in: int, d_out: int, tp: tpx.TPInfo, bias: bool):
        super().__init__()
        self.weight = make_param(d_out // tp.size, d_in, tp_dim=0, kind="normal")
        self.bias = make_param(d_out // tp.size, tp_dim=0, kind="zeros") if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """Row-parallel: weight [out, in/tp]; partial sums reduced by `tpx.exit_`, then the bias."""

    def __init__(self, d_in: int, d_out: int, tp: tpx.TPInfo, bias: bool):
        super().__init__()
        self.tp = tp
        self.weight = make_param(d_out, d_in // tp.size, tp_dim=1, kind="proj")
        self.bias = make_param(d_out, tp_dim=None, kind="zeros") if bias else None

    def forward(self, x):
        out = tpx.exit_(F.linear(x, self.weight), self.tp)
        return out if self.bias is None else out + self.bias
