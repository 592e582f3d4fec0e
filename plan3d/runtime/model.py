"""The GPT decoder of a ModelSpec, built as pipeline stage modules with tensor-parallel shards.

Pre-norm decoder (GPT-2, Radford et al. 2019; Llama, Touvron et al. 2023): learned or rotary
positions (RoPE, Su et al. 2021, arXiv:2104.09864), grouped-query attention (Ainslie et al. 2023,
arXiv:2305.13245), GELU or SwiGLU MLP (Shazeer 2020, arXiv:2002.05202), LayerNorm or RMSNorm.
Q, K, V and gate/up are separate matrices so that a tp shard is a plain slice of each, and so that
a checkpoint holds layout-independent tensors (reshard on load).

With context parallelism (`runtime/cp.py`) each rank holds s/cp tokens of every sequence at known
global positions: the learned position embedding and RoPE use those positions, and attention
all-gathers K/V over the cp group under a causal mask of global positions.

MoE layers (`ModelSpec.is_moe_layer`) replace the MLP by `runtime/moe.py`'s routed experts, each
expert named by its global index, so that its initial values and checkpoint key do not depend on
the expert-parallel degree.

Initial weights do not depend on the layout: each parameter's FULL tensor is drawn from a
generator seeded by (seed, logical name), then this rank's tp slice is kept (GPT-2 init: normal
0.02, output projections 0.02/sqrt(2 * layers)).
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plan3d.runtime import cp as cpx
from plan3d.runtime import tp as tpx
from plan3d.runtime.layers import ColLinear, RowLinear, make_param, tag_param
from plan3d.runtime.moe import MoE, EPInfo
from plan3d.specs.model import ModelSpec

TIED = "embed.tok.weight"


def _norm(model: ModelSpec) -> nn.Module:
    eps = model.norm_eps_  # the spec's epsilon (default 1e-5)
    norm = nn.LayerNorm(model.hidden, eps=eps) if model.norm == "layernorm" else nn.RMSNorm(model.hidden, eps=eps)
    for name, p in norm.named_parameters():
        tag_param(p, None, "ones" if name == "weight" else "zeros")
    return norm


def rope(x: torch.Tensor, theta: float = 10000.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of [b, heads, s, d] (rotate-half form); `positions` [s]: the tokens'
    global positions (default 0 .. s-1)."""
    d, s = x.shape[-1], x.shape[-2]
    freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pos = torch.arange(s, device=x.device) if positions is None else positions
    angle = torch.outer(pos.to(torch.float32), freq)
    cos, sin = angle.cos().repeat(1, 2).to(x.dtype), angle.sin().repeat(1, 2).to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, selective_recompute: bool, cp: cpx.CPInfo = cpx.CPInfo()):
        super().__init__()
        self.cp = cp
        self.d, self.rope = model.head_dim_, model.position == "rope"
        self.theta = model.rope_theta or 10000.0  # the spec's RoPE base (default 10000, as Megatron-Core's)
        self.heads, self.kv = model.heads // tp.size, model.kv_heads_ // tp.size
        self.recompute = selective_recompute
        self.q = ColLinear(model.hidden, model.heads * self.d, tp, model.qkv_bias_)
        self.k = ColLinear(model.hidden, model.kv_heads_ * self.d, tp, model.qkv_bias_)
        self.v = ColLinear(model.hidden, model.kv_heads_ * self.d, tp, model.qkv_bias_)
        self.o = RowLinear(model.heads * self.d, model.hidden, tp, model.bias)

    def _core(self, q, k, v):
        if self.rope:
            q, k = rope(q, self.theta), rope(k, self.theta)
        if self.kv < self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _masked_core(self, q, k, v, mask):
        if self.kv < self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _ring_block(self, q, k, v, mask):
        """One block of ring attention (`cpx.ring_attention`), recomputed in the backward under
        selective recompute; K/V travel the ring with kv heads and are repeated here."""
        def attend(q, k, v, mask):
            if self.kv < self.heads:
                k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
            return cpx.block_attention(q, k, v, mask)

        return checkpoint(attend, q, k, v, mask, use_reentrant=False) if self.recompute else attend(q, k, v, mask)

    def _context_parallel(self, q, k, v):
        """Local queries [b, heads, s/cp, d] against the keys and values of the whole sequence,
        all-gathered over the cp group (outside any selective recompute: no collective is replayed)."""
        seq = q.shape[-2] * self.cp.size
        mine = cpx.positions(seq, self.cp.size, self.cp.rank, q.device)
        if self.rope:
            q, k = rope(q, self.theta, mine), rope(k, self.theta, mine)
        if self.cp.comm == "p2p":
            return cpx.ring_attention(q, k, v, self.cp, mine, self._ring_block)
        k, v = (cpx.gather_sequence(t, self.cp, dim=2) for t in (k, v))
        mask = cpx.causal_mask(mine, cpx.gathered_positions(seq, self.cp.size, q.device))
        if self.recompute:
            return checkpoint(self._masked_core, q, k, v, mask, use_reentrant=False)
        return self._masked_core(q, k, v, mask)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, -1, self.d).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.cp.size > 1:
            y = self._context_parallel(q, k, v)
        else:
            y = checkpoint(self._core, q, k, v, use_reentrant=False) if self.recompute else self._core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


class MLP(nn.Module):
    def __init__(self, model: ModelSpec, tp: tpx.TPInfo):
        super().__init__()
        self.swiglu = model.activation == "swiglu"
        self.act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "swiglu": F.silu}[model.activation]
        self.up = ColLinear(model.hidden, model.ffn_hidden_, tp, model.bias)
        self.gate = ColLinear(model.hidden, model.ffn_hidden_, tp, model.bias) if self.swiglu else None
        self.down = RowLinear(model.ffn_hidden_, model.hidden, tp, model.bias)

    def forward(self, x):
        hidden = self.act(self.gate(x)) * self.up(x) if self.swiglu else self.act(self.up(x))
        return self.down(hidden)


class Block(nn.Module):
    """x [b, s (or s/tp with SP), h] -> same; the norms run on sequence shards under SP."""

    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, recompute: str, cp: cpx.CPInfo = cpx.CPInfo(),
                 index: int = 0, ep: EPInfo = EPInfo()):
        super().__init__()
        self.tp, self.full_recompute = tp, recompute == "full"
        self.norm1, self.norm2 = _norm(model), _norm(model)
        self.attn = Attention(model, tp, recompute == "selective", cp)
        self.routed = model.is_moe_layer(index)
        self.mlp = MoE(model, tp, ep) if self.routed else MLP(model, tp)

    def _forward(self, x):
        x = x + self.attn(tpx.enter(self.norm1(x), self.tp))
        if self.routed:  # the MoE layer handles its own tp region (runtime/moe.py)
            return x + self.mlp(self.norm2(x))
        return x + self.mlp(tpx.enter(self.norm2(x), self.tp))

    def forward(self, x):
        return checkpoint(self._forward, x, use_reentrant=False) if self.full_recompute else self._forward(x)


class Embedding(nn.Module):
    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, cp: cpx.CPInfo = cpx.CPInfo()):
        super().__init__()
        self.tp, self.cp = tp, cp
        self.tok = nn.Module()
        self.tok.weight = make_param(model.vocab // tp.size, model.hidden, tp_dim=0, kind="normal")
        self.pos = None
        if model.position == "learned":
            self.pos = nn.Module()
            self.pos.weight = make_param(model.seq_len, model.hidden, tp_dim=None, kind="normal")

    def forward(self, tokens):
        x = tpx.vocab_embedding(tokens, self.tok.weight, self.tp)
        if self.pos is not None:
            x = x + tpx.seq_shard(self._positions(tokens.shape[1]).unsqueeze(0), self.tp)
        return x

    def _positions(self, local_seq: int) -> torch.Tensor:
        """Position embeddings of this rank's tokens: the first s, or under cp the global
        positions of its two chunks."""
        if self.cp.size == 1:
            return self.pos.weight[:local_seq]
        seq = local_seq * self.cp.size
        return self.pos.weight[cpx.positions(seq, self.cp.size, self.cp.rank, self.pos.weight.device)]


class Head(nn.Module):
    """Final norm and the vocabulary-parallel output layer -> local logits [b, s, V/tp]."""

    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, own_weight: bool):
        super().__init__()
        self.tp = tp
        self.norm = _norm(model)
        self.out = None
        if own_weight:
            self.out = nn.Module()
            self.out.weight = make_param(model.vocab // tp.size, model.hidden, tp_dim=0, kind="normal")

    def forward(self, x, tied_weight=None):
        weight = tied_weight if self.out is None else self.out.weight
        return F.linear(tpx.enter(self.norm(x), self.tp), weight)


class Stage(nn.Module):
    """One (virtual) pipeline stage: [embedding] + layers [first, last) + [head]."""

    def __init__(self, model: ModelSpec, tp: tpx.TPInfo, layers: range, first: bool, last: bool,
                 recompute: str = "none", amp_dtype: torch.dtype | None = None, cp: cpx.CPInfo = cpx.CPInfo(),
                 ep: EPInfo = EPInfo()):
        super().__init__()
        self.amp_dtype = amp_dtype
        self.embed = Embedding(model, tp, cp) if first else None
        self.layers = nn.ModuleDict({str(i): Block(model, tp, recompute, cp, i, ep) for i in layers})
        self.shares_embedding = model.tied_embeddings and first and last
        self.head = Head(model, tp, own_weight=not self.shares_embedding) if last else None
        self.tied_copy = "head.out.weight" if model.tied_embeddings and last and not first else None

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            if self.embed is not None:
                x = self.embed(x)
            for block in self.layers.values():
                x = block(x)
            if self.head is not None:
                x = self.head(x, self.embed.tok.weight if self.shares_embedding else None)
        return x


def logical_name(stage: Stage, name: str) -> str:
    """Name of a parameter in layout-independent terms (the tied copy is the embedding)."""
    return TIED if name == stage.tied_copy else name


def _full_init(name: str, kind: str, shape: tuple[int, ...], seed: int, layers: int) -> torch.Tensor:
    if kind in ("ones", "zeros"):
        return (torch.ones if kind == "ones" else torch.zeros)(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * layers) if kind == "proj" else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def global_shape(param: nn.Parameter, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if param.tp_dim is not None:
        shape[param.tp_dim] *= tp_size
    return tuple(shape)


@torch.no_grad()
def init_stage(stage: Stage, tp: tpx.TPInfo, seed: int, layers: int) -> None:
    """Fill every parameter with its slice of the layout-independent full initial tensor."""
    for name, param in stage.named_parameters():
        full = _full_init(logical_name(stage, name), param.init_kind, global_shape(param, tp.size), seed, layers)
        if param.tp_dim is not None:
            full = full.chunk(tp.size, dim=param.tp_dim)[tp.rank]
        param.copy_(full)
