"""Context parallelism in the bundled runtime (plan3d/runtime/cp.py).

Fast single-process checks: Megatron's 2*cp chunk split and its inverse, the causal mask of global
positions, attention and position embeddings of every cp rank against the full sequence, the
DeviceMesh's cp and dp x cp groups, the refusal of a sequence not divisible by 2*cp.

Launched (slow; three multi-process runs, losses within 1e-5 of one process):
- cp4 alone (4 ranks, selective recompute, checkpoint written at the end);
- cp2 tp2 pp2 with sequence parallelism (8 ranks) on the Llama-style tiny model (RoPE, GQA,
  SwiGLU, tied embeddings over two stages), trained on the bundled text, against one process of
  the same model (the session's `llama_reference`);
- cp2 dp2 with ZeRO-1 (4 ranks): gradients and the optimizer shards over dp x cp, model-state
  bytes checked.
"""
from __future__ import annotations

import pytest
import torch

from runtime_helpers import (STEPS, TOKEN_DATA, assert_same_losses, check_completed_run, check_mesh_groups,
                             check_model_state, launched, llama_style, make_plan, metrics)


# ---- the sequence split -----------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
def test_split_keeps_chunks_r_and_2cp_minus_1_minus_r_and_merge_inverts_it(cp):
    from plan3d.runtime.cp import merge_sequence, positions, split_sequence

    seq = 8 * cp
    tokens = torch.arange(3 * seq).reshape(3, seq)
    parts = [split_sequence(tokens, cp, r) for r in range(cp)]
    chunk = seq // (2 * cp)
    for r, part in enumerate(parts):
        assert part.shape == (3, seq // cp)
        want = list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
        assert part[0].tolist() == want
        assert positions(seq, cp, r).tolist() == want
    assert torch.equal(merge_sequence(parts), tokens)
    assert sorted(torch.cat([positions(seq, cp, r) for r in range(cp)]).tolist()) == list(range(seq))


def test_every_cp_rank_attends_the_same_number_of_key_query_pairs():
    """The reason for the 2*cp chunks: each rank's causal work is equal (Megatron's balancing)."""
    from plan3d.runtime.cp import causal_mask, gathered_positions, positions

    seq, cp = 32, 4
    keys = gathered_positions(seq, cp)
    work = [int(causal_mask(positions(seq, cp, r), keys).sum()) for r in range(cp)]
    assert len(set(work)) == 1 and sum(work) == seq * (seq + 1) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_mask_of_global_positions_is_the_full_causal_mask_permuted(cp):
    from plan3d.runtime.cp import causal_mask, gathered_positions, positions

    seq = 4 * cp
    full = torch.ones(seq, seq, dtype=torch.bool).tril()
    keys = gathered_positions(seq, cp)
    for r in range(cp):
        mine = positions(seq, cp, r)
        assert torch.equal(causal_mask(mine, keys), full[mine][:, keys])


@pytest.mark.parametrize("seq, cp", [(36, 4), (6, 2)])
def test_a_sequence_not_divisible_by_2cp_is_refused_in_one_line(seq, cp):
    from plan3d.errors import LaunchError
    from plan3d.run.launch import runtime_problems
    from plan3d.runtime.cp import check_seq, split_sequence

    with pytest.raises(LaunchError) as err:
        check_seq(seq, cp)
    assert f"cp={cp}" in str(err.value) and f"seq={seq}" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(LaunchError):
        split_sequence(torch.zeros(1, seq), cp, 0)
    plan = make_plan(cp=cp)
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"seq_len": seq})})
    problems = runtime_problems(plan)
    assert any(f"cp={cp}" in p and f"sequence length {seq} is not divisible by {2 * cp}" in p for p in problems), problems
    assert not runtime_problems(make_plan(cp=cp))


# ---- the model pieces on every cp rank against the full sequence ------------------------------
def _llama(model):
    return model.model_copy(update=dict(kv_heads=2, activation="swiglu", ffn_hidden=128, norm="rmsnorm",
                                        bias=False, position="rope", tied_embeddings=True))


class _ReplayGather:
    """Stands in for the cp all-gather in one process: a first pass records what every cp rank
    contributes (K then V), a second pass returns the concatenation of all ranks' contributions."""

    def __init__(self):
        self.sent: dict[int, list[torch.Tensor]] = {}
        self.calls: dict[int, int] = {}
        self.replay = False

    def __call__(self, x, cp, dim):
        if not self.replay:
            self.sent.setdefault(cp.rank, []).append(x.detach())
            return torch.cat([x] * cp.size, dim=dim)
        i = self.calls.get(cp.rank, 0) % len(self.sent[cp.rank])  # K, V, K, V, ...
        self.calls[cp.rank] = i + 1
        return torch.cat([self.sent[r][i] for r in range(cp.size)], dim=dim)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("llama", [False, True])
def test_attention_of_every_cp_rank_equals_its_rows_of_full_attention(cp, llama, monkeypatch):
    """RoPE at global positions, GQA, the gathered K/V order and the mask together: the local
    outputs of all cp ranks, merged, are the single-process attention output."""
    from plan3d.runtime import cp as cpx
    from plan3d.runtime.model import Attention
    from plan3d.runtime.tp import TPInfo

    model = make_plan().model
    model = _llama(model) if llama else model
    tp = TPInfo(1, 0, None, False)
    torch.manual_seed(0)
    full = Attention(model, tp, selective_recompute=False)
    with torch.no_grad():
        for param in full.parameters():
            param.normal_(0.0, 0.2)
    x = torch.randn(2, model.seq_len, model.hidden)
    want = full(x)
    ranks = [Attention(model, tp, selective_recompute=r % 2 == 1, cp=cpx.CPInfo(cp, r)) for r in range(cp)]
    for attn in ranks:
        attn.load_state_dict(full.state_dict())
    gather = _ReplayGather()
    monkeypatch.setattr(cpx, "gather_sequence", gather)
    local = [cpx.split_sequence(x, cp, r) for r in range(cp)]
    for attn, xr in zip(ranks, local):
        attn(xr)
    gather.replay = True
    got = cpx.merge_sequence([attn(xr) for attn, xr in zip(ranks, local)])
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    shifted = cpx.merge_sequence([ranks[0](xr) for xr in local])  # every rank's tokens at rank 0's positions
    assert not torch.allclose(shifted, want, atol=1e-3)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_blocks_merged_equal_attention_to_all_keys(cp):
    """The ring's arithmetic in one process: each rank's queries against every rank's K/V block
    in ring order (its own first), merged by log-sum-exp, equal masked attention to the whole
    gathered sequence -- including the blocks a query row sees nothing of (fully masked)."""
    from plan3d.runtime.cp import block_attention, causal_mask, merge_blocks, positions

    torch.manual_seed(1)
    seq, heads, d = 8 * cp, 3, 4
    q, k, v = (torch.randn(2, heads, seq, d, dtype=torch.float64) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    fully_masked_seen = False
    for r in range(cp):
        mine = positions(seq, cp, r)
        out = lse = None
        for step in range(cp):
            theirs = positions(seq, cp, (r - step) % cp)
            mask = causal_mask(mine, theirs)
            fully_masked_seen |= bool((~mask).all(dim=1).any())
            block = block_attention(q[:, :, mine], k[:, :, theirs], v[:, :, theirs], mask)
            out, lse = block if out is None else merge_blocks(out, lse, *block)
        assert torch.allclose(out.double(), full[:, :, mine], atol=1e-6), (out.double() - full[:, :, mine]).abs().max()
    assert fully_masked_seen


def test_learned_position_embedding_uses_the_global_positions_of_the_chunks():
    from plan3d.runtime.cp import CPInfo, merge_sequence, split_sequence
    from plan3d.runtime.model import Embedding, Stage, init_stage
    from plan3d.runtime.tp import TPInfo

    plan, tp, cp = make_plan(), TPInfo(1, 0, None, False), 4
    stage = Stage(plan.model, tp, range(0), first=True, last=False)
    init_stage(stage, tp, seed=3, layers=plan.model.layers)
    tokens = torch.randint(plan.model.vocab, (2, plan.model.seq_len))
    want = stage.embed(tokens)
    parts = []
    for r in range(cp):
        embed = Embedding(plan.model, tp, CPInfo(cp, r))
        embed.load_state_dict(stage.embed.state_dict())
        parts.append(embed(split_sequence(tokens, cp, r)))
    assert torch.equal(merge_sequence(parts), want)


# ---- the DeviceMesh -----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_cp_mesh_holds_the_plans_cp_dp_and_dp_cp_groups(order):
    """The runtime's own mesh builders on torch's in-process fake backend, every rank in turn."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plan3d.runtime.context import flatten_dp_cp, mesh_array, mesh_dims

    plan = make_plan(tp=2, cp=2, dp=2, order=order)
    groups = plan.rankmap.groups
    for rank in range(plan.layout.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.layout.world_size)
        try:
            mesh = DeviceMesh("cpu", mesh_array(plan.rankmap, plan.layout), mesh_dim_names=mesh_dims(plan.layout))
            for dim in ("tp", "cp", "dp", "pp"):
                assert dist.get_process_group_ranks(mesh.get_group(dim)) == next(g for g in groups[dim] if rank in g)
            flat = flatten_dp_cp(mesh, backend_override=None)
            want = next(g for g in groups["dp_cp"] if rank in g)
            assert dist.get_process_group_ranks(flat.get_group()) == want
            assert flat.get_local_rank() == want.index(rank)
        finally:
            dist.destroy_process_group()


# ---- launched: losses equal to one process ------------------------------------------------------
CP_GROUPS = ("tp", "cp", "dp", "pp", "dp_cp")  # every rank's groups, dp x cp included


@pytest.mark.slow
def test_cp4_alone_matches_single_process(reference, tmp_path):
    plan = make_plan(cp=4, recompute="selective")
    ranks = launched(plan, tmp_path, extra=())
    assert_same_losses(metrics(tmp_path), reference, range(1, STEPS + 1))
    assert sorted(r["cp"] for r in ranks) == [0, 1, 2, 3]
    check_mesh_groups(plan, ranks, CP_GROUPS)
    check_model_state(plan, ranks)  # cp changes no parameter or gradient
    assert (tmp_path / "checkpoints" / f"step_{STEPS:08d}").is_dir()


@pytest.mark.slow
def test_llama_style_cp2_tp2_pp2_sequence_parallel_matches_single_process(llama_reference, tmp_path):
    """RoPE at global positions, GQA and tied embeddings over two stages, with tp (sequence
    parallel: each tp rank holds its share of the cp rank's chunks) and pp, on token data."""
    plan = llama_style(make_plan(cp=2, tp=2, pp=2, sequence_parallel=True))
    ranks = launched(plan, tmp_path, extra=["--no-save", *TOKEN_DATA])
    check_completed_run(plan, tmp_path, llama_reference)
    check_mesh_groups(plan, ranks, CP_GROUPS)


@pytest.mark.slow
def test_llama_style_cp4_ring_with_selective_recompute_matches_single_process(llama_reference, tmp_path):
    """--cp-comm p2p: K/V passed round the ring (runtime/cp.py ring_attention) with GQA, RoPE at
    global positions and the attention blocks recomputed in the backward."""
    from plan3d.specs.catalog import load_engine

    engine = load_engine("plan3d-runtime").with_cp_comm("p2p")
    plan = llama_style(make_plan(cp=4, recompute="selective", engine=engine))
    ranks = launched(plan, tmp_path, extra=["--no-save", *TOKEN_DATA])
    assert [r["cp_comm"] for r in ranks] == ["p2p"] * 4
    check_completed_run(plan, tmp_path, llama_reference)
    check_mesh_groups(plan, ranks, CP_GROUPS)


@pytest.mark.slow
def test_cp2_dp2_zero1_matches_single_process(reference, tmp_path):
    """ZeRO-1 over dp x cp: gradients all-reduced and the optimizer sharded over the 4 ranks."""
    plan = make_plan(cp=2, dp=2, zero=1)
    ranks = launched(plan, tmp_path)
    check_completed_run(plan, tmp_path, reference)
    check_mesh_groups(plan, ranks, CP_GROUPS)
