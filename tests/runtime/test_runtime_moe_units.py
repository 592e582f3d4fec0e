"""The MoE layer of the bundled runtime (plan3d/runtime/moe.py), in one process: routing, the
dropless dispatch against a per-token reference, shared experts and their gate, expert names
and layout-independent initial values, the expert mesh's groups, and the launcher's refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime_helpers import make_plan


def _tiny_moe(**moe_update):
    from plan3d.specs.catalog import load_model

    model = load_model("tiny-moe")
    return model.model_copy(update={"moe": model.moe.model_copy(update=moe_update)}) if moe_update else model


def _layer(model, seed=0):
    from plan3d.runtime.moe import MoE
    from plan3d.runtime.tp import TPInfo

    torch.manual_seed(seed)
    layer = MoE(model, TPInfo(1, 0, None, False))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    return layer


def _act(model, t):
    return F.gelu(t, approximate="tanh") if model.activation == "gelu" else F.silu(t)


def _expert_by_hand(model, expert, x):
    up = F.linear(x, expert.up.weight, expert.up.bias)  # by hand, not the module's code
    hidden = _act(model, F.linear(x, expert.gate.weight, expert.gate.bias)) * up if expert.gate is not None else _act(model, up)
    return F.linear(hidden, expert.down.weight, expert.down.bias)


def _by_hand(model, layer, x):
    """Token by token: scores, top_k, renormalised weights, sum of weighted expert outputs."""
    moe, out = model.moe, []
    for token in x.reshape(-1, model.hidden):
        logits = F.linear(token, layer.router.weight, layer.router.bias)
        scores = logits.softmax(-1) if moe.router == "softmax" else logits.sigmoid()
        top, ids = scores.topk(moe.top_k)
        y = sum(w / top.sum() * _expert_by_hand(model, layer.experts[str(int(e))], token) for w, e in zip(top, ids))
        if layer.shared is not None:
            s = layer.shared
            shared = _expert_by_hand(model, s, token)
            y = y + (shared * torch.sigmoid(token @ s.scale.weight[0]) if s.scale is not None else shared)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(router="sigmoid", top_k=3),
    dict(shared_ffn_hidden=32, shared_expert_gate=True),
    dict(swiglu=True, shared_ffn_hidden=32),
])
def test_moe_layer_equals_the_per_token_computation(variant):
    swiglu = variant.pop("swiglu", False)
    model = _tiny_moe(**variant)
    if swiglu:
        model = model.model_copy(update=dict(activation="swiglu", bias=False))
    layer = _layer(model)
    x = torch.randn(2, 8, model.hidden, requires_grad=True)
    got = layer(x)
    want = _by_hand(model, layer, x)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    (got.pow(2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    x_grad, x.grad = x.grad.clone(), None
    layer.zero_grad()
    want.pow(2).sum().backward()
    assert torch.allclose(x_grad, x.grad, rtol=1e-4, atol=1e-5)
    for name, p in layer.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-5), name
    assert layer.router.weight.grad.abs().sum() > 0  # the router learns (top_k > 1 keeps a gradient)


def test_routing_renormalises_the_top_k_scores():
    from plan3d.runtime.moe import route

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 0.5, 0.0]])
    weights, ids = route(logits, 2, "softmax")
    assert ids.tolist() == [[3, 2], [0, 2]]
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    p = logits.softmax(-1)
    assert torch.allclose(weights[0], p[0, [3, 2]] / p[0, [3, 2]].sum())
    sig, _ = route(logits, 2, "sigmoid")
    s = logits.sigmoid()
    assert torch.allclose(sig[1], s[1, [0, 2]] / s[1, [0, 2]].sum())


def test_dispatch_plan_groups_rows_by_expert_for_one_rank():
    from plan3d.runtime.moe import EPInfo, plan_dispatch

    ids = torch.tensor([[3, 0], [1, 3], [0, 2]])
    plan = plan_dispatch(ids, 4, EPInfo())
    assert ids.reshape(-1)[plan.order].tolist() == [0, 0, 1, 2, 3, 3]
    assert plan.send == plan.recv == [6]
    assert plan.per_expert == [2, 1, 1, 2]
    assert plan.by_expert.tolist() == list(range(6))  # one rank: what it receives is already sorted


def test_experts_are_named_by_global_index_and_initialised_independently_of_ep():
    """The expert modules of ep rank r are experts r*E/ep ..; each one's initial tensor is the
    one one process draws for the same name."""
    from plan3d.runtime.model import Stage, init_stage
    from plan3d.runtime.moe import EPInfo
    from plan3d.runtime.tp import TPInfo

    model, tp = _tiny_moe(), TPInfo(1, 0, None, False)
    one = Stage(model, tp, range(model.layers), first=True, last=True)
    init_stage(one, tp, seed=5, layers=model.layers)
    full = dict(one.named_parameters())
    assert isinstance(one.layers["0"].mlp, torch.nn.Module) and one.layers["0"].routed and not one.layers["1"].routed
    for rank in range(4):
        stage = Stage(model, tp, range(model.layers), first=True, last=True, ep=EPInfo(4, rank))
        init_stage(stage, tp, seed=5, layers=model.layers)
        experts = sorted({n.split(".")[4] for n, _ in stage.named_parameters() if ".experts." in n}, key=int)
        assert experts == [str(2 * rank), str(2 * rank + 1)]
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name]), name
            assert getattr(p, "expert", False) == (".experts." in name)


def test_tp_slices_of_an_expert_add_up_to_the_whole_expert():
    """Expert tensor parallelism: the column slices of up and the row slices of down, each tp
    rank's partial output summed, equal the unsplit expert (what the tp all-reduce computes)."""
    from plan3d.runtime.model import Stage, init_stage
    from plan3d.runtime.tp import TPInfo

    model = _tiny_moe()
    one_tp = TPInfo(1, 0, None, False)
    whole = Stage(model, one_tp, range(1), first=False, last=False)
    init_stage(whole, one_tp, seed=7, layers=model.layers)
    x = torch.randn(5, model.hidden)
    expert = whole.layers["0"].mlp.experts["6"]
    want = expert(x)
    parts = []
    for rank in range(2):
        tp = TPInfo(2, rank, None, False)
        stage = Stage(model, tp, range(1), first=False, last=False)
        init_stage(stage, tp, seed=7, layers=model.layers)
        parts.append(stage.layers["0"].mlp.experts["6"].partial(x))
    assert torch.allclose(parts[0] + parts[1] + expert.down.bias, want, atol=1e-6)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_expert_mesh_holds_the_plans_ep_and_edp_groups(order):
    """The runtime's expert mesh on torch's in-process fake backend, every rank in turn."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plan3d.runtime.context import EXPERT_MESH_DIMS, expert_mesh_array

    plan = _moe_plan(tp=2, dp=4, ep=2, order=order)
    groups = plan.rankmap.groups
    for rank in range(plan.layout.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.layout.world_size)
        try:
            mesh = DeviceMesh("cpu", expert_mesh_array(plan.rankmap, plan.layout), mesh_dim_names=EXPERT_MESH_DIMS)
            for dim in ("ep", "edp", "tp", "pp"):
                want = next(g for g in groups[dim] if rank in g)
                assert dist.get_process_group_ranks(mesh.get_group(dim)) == want, dim
        finally:
            dist.destroy_process_group()


def _moe_plan(**layout_flags):
    from plan3d.cli.common import load_specs, make_layout
    from plan3d.layout import check_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("local-cpu", "tiny-moe", None, None, None, None, "fp32")
    layout = make_layout(**layout_flags)
    check_layout(layout, model, training, cluster.world_size)
    return build_plan(cluster, model, training, layout, {})


def _with_moe(plan, **moe_update):
    model = plan.model.model_copy(update={"moe": plan.model.moe.model_copy(update=moe_update)})
    return plan.model_copy(update={"model": model})


def test_launcher_refuses_what_the_moe_runtime_cannot_run_in_one_line_each():
    from plan3d.run.launch import runtime_problems
    from plan3d.specs.model import MLASpec

    assert runtime_problems(_moe_plan(ep=2, dp=2)) == []
    assert runtime_problems(_moe_plan(ep=4, dp=4, tp=2, zero=1)) == []
    ep2 = _moe_plan(ep=2, dp=2)  # a plan file edited by hand: ep=2 on a dense model (check_layout refuses it too)
    dense = ep2.model_copy(update={"model": ep2.model.model_copy(update={"moe": None})})
    assert any("ep=2 needs a mixture-of-experts model" in p for p in runtime_problems(dense))
    assert runtime_problems(make_plan(dp=2)) == []
    assert runtime_problems(_moe_plan(ep=2, dp=2, zero=3)) == []  # FSDP2 units per expert over edp
    assert any("capacity_factor" in p for p in runtime_problems(_with_moe(_moe_plan(), capacity_factor=1.25)))
    assert any("ep=4 does not divide the 6 routed experts" in p
               for p in runtime_problems(_with_moe(_moe_plan(ep=4, dp=4), experts=6)))
    assert any("expert_ffn_hidden=66" in p for p in runtime_problems(_with_moe(_moe_plan(tp=4), expert_ffn_hidden=66)))
    plan = _moe_plan()
    mla = plan.model.model_copy(update={"mla": MLASpec(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)})
    assert any("MLA" in p for p in runtime_problems(plan.model_copy(update={"model": mla})))
    assert all("\n" not in p for p in runtime_problems(_with_moe(_moe_plan(ep=4, dp=4, zero=3), experts=6, capacity_factor=1.0)))


def _one_rank_context():
    from plan3d.runtime.context import ParallelContext
    from plan3d.runtime.tp import TPInfo

    sizes = {"pp": 1, "dp": 1, "tp": 1, "cp": 1}
    return ParallelContext(0, 1, None, {d: 0 for d in sizes}, torch.device("cpu"), TPInfo(1, 0, None, False),
                           None, sizes)


@pytest.mark.parametrize("flat", [False, True])
def test_expert_gradients_are_divided_by_the_batch_replicas_not_the_expert_replicas(flat):
    """An ep rank whose experts have no replica (edp = 1) still divides their gradients by
    dp x cp (here 2): the all-to-all already summed the tokens of both ep ranks. SplitDP adds
    up the two engines' norms and bytes."""
    from plan3d.runtime.context import Replicas
    from plan3d.runtime.dp import ReplicatedDP, SplitDP
    from plan3d.runtime.engine import collect_entries
    from plan3d.runtime.model import Stage, init_stage
    from plan3d.runtime.zero import FlatZeroDP

    model, ctx = _tiny_moe(), _one_rank_context()
    stage = Stage(model, ctx.tp, range(1), first=True, last=True)
    init_stage(stage, ctx.tp, seed=1, layers=model.layers)
    entries = collect_entries([stage], ctx)
    experts = [e for e in entries if e.expert]
    dense = [e for e in entries if not e.expert]
    assert experts and dense and all(".experts." in e.name for e in experts)
    mine, halved = Replicas(1, 0, None, 1), Replicas(1, 0, None, 2)
    make = (lambda part, r: FlatZeroDP(part, ctx, "adam", 1e-3, 1, replicas=r)) if flat else \
        (lambda part, r: ReplicatedDP(part, ctx, "adam", 1e-3, r))
    engine = SplitDP(make(dense, mine), make(experts, halved))
    tokens = torch.randint(model.vocab, (2, model.seq_len))
    raw = {}
    for e in entries:
        e.param.register_hook(lambda g, name=e.name: raw.__setitem__(name, g.clone()))
    F.cross_entropy(stage(tokens).flatten(0, 1), tokens.flatten()).backward()
    engine.reduce_grads()
    for part in engine.parts:
        for e in part.entries:
            got = part.view(part.main_grad, e) if flat else e.param.grad
            want = raw[e.name] / (2 if e.expert else 1)
            assert torch.allclose(got, want, atol=1e-9), e.name
    assert torch.isclose(engine.grad_sq_sum(), engine.dense.grad_sq_sum() + engine.experts.grad_sq_sum())
    total = engine.state_bytes()
    assert total["weights"] == sum(p.numel() * 4 for p in stage.parameters())


def test_a_worker_started_by_an_emitted_script_refuses_what_the_runtime_cannot_train(tmp_path):
    """`plan3d emit torchrun/slurm` start the workers without `plan3d launch`: the worker's own
    reading of plan.json refuses an expert tp other than tp, in the launcher's words."""
    from plan3d.errors import LaunchError
    from plan3d.layout import Layout
    from plan3d.plan import build_plan, save_plan
    from plan3d.runtime.train import _read_plan
    from plan3d.specs.catalog import load_cluster, load_model
    from plan3d.specs.training import TrainingSpec

    model = load_model("mixtral-8x7b")
    plan = build_plan(load_cluster("dgx-h100", 1), model, TrainingSpec(global_batch=64),
                      Layout(tp=2, dp=4, ep=8, etp=1, zero=1, sequence_parallel=True))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    with pytest.raises(LaunchError, match=r"^plan3d-runtime splits experts over tp only: drop etp \(expert tensor parallel = tp\)$"):
        _read_plan(str(path))
    save_plan(make_plan(dp=2), tmp_path / "ok.json")
    assert _read_plan(str(tmp_path / "ok.json")).layout.dp == 2
