"""Single-process checks of the runtime's pure parts, the launcher's commands and the CLI."""
from __future__ import annotations

import shlex

import pytest
import torch

from runtime_helpers import make_plan


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-cp-ep-tp-pp"])
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 1, 4)])
def test_mesh_from_rank_map_holds_the_plans_groups(order, shape):
    from plan3d.runtime.context import MESH_DIMS, mesh_array

    tp, pp, dp = shape
    plan = make_plan(tp=tp, pp=pp, dp=dp, order=order)
    mesh = mesh_array(plan.rankmap, plan.layout)
    for axis, dim in enumerate(MESH_DIMS):
        groups = sorted(tuple(row) for row in mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist())
        assert groups == sorted(tuple(g) for g in plan.rankmap.groups[dim])


def _params(tp_size: int, tp_rank: int, ranges) -> dict[str, torch.Tensor]:
    from plan3d.runtime.model import Stage, init_stage
    from plan3d.runtime.tp import TPInfo

    plan = make_plan()
    tp = TPInfo(tp_size, tp_rank, None, False)
    out = {}
    for i, layers in enumerate(ranges):
        stage = Stage(plan.model, tp, layers, first=i == 0, last=i == len(ranges) - 1)
        init_stage(stage, tp, seed=7, layers=plan.model.layers)
        out.update({n: (p.detach(), p.tp_dim) for n, p in stage.named_parameters()})
    return out


def test_initial_weights_do_not_depend_on_the_layout():
    full = _params(1, 0, [range(0, 8)])
    split = [_params(2, r, [range(0, 3), range(3, 8)]) for r in (0, 1)]
    assert set(full) == set(split[0])
    for name, (tensor, _) in full.items():
        shards, dim = [s[name][0] for s in split], split[0][name][1]
        joined = shards[0] if dim is None else torch.cat(shards, dim=dim)
        assert torch.equal(joined, tensor), name


def test_data_parallel_replicas_cover_the_global_batch():
    from plan3d.runtime.data import global_batch, replica_batch

    whole = global_batch(3, 5, 8, 16, 64)
    parts = [replica_batch(3, 5, 8, 16, 64, 4, d) for d in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole[:, :-1])
    assert torch.equal(torch.cat([y for _, y in parts]), whole[:, 1:])
    assert not torch.equal(whole, global_batch(3, 6, 8, 16, 64))


def test_torchrun_commands_use_the_static_rendezvous():
    from plan3d.emit.torchrun import torchrun_commands

    cmds = torchrun_commands("p.json", 16, 2, 8, "node0", 29511, ["--steps", "3"])
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        assert "--rdzv-backend=static" in cmd and f"--node-rank={node}" in cmd
        assert "--nproc-per-node=8" in cmd and "--master-addr=node0" in cmd and "--master-port=29511" in cmd
        assert cmd[-4:] == ["--plan", "p.json", "--steps", "3"]


def test_sbatch_script_takes_node_rank_and_master_from_slurm():
    from plan3d.emit.slurm import sbatch_script

    plan = make_plan(nodes=2, gpus_per_node=4, tp=2, pp=2, dp=2)
    script = sbatch_script(plan, "plan.json", steps=5)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "SLURM_NODEID" in script and "SLURM_PROCID" in script
    assert 'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script and "export MASTER_ADDR" in script
    assert '--node-rank "$NODE_RANK"' in script and "--nnodes 2" in script


def test_placement_problems_name_the_misplaced_rank():
    from plan3d.runtime.context import placement_problems

    plan = make_plan(nodes=2, gpus_per_node=4, tp=2, pp=2, dp=2)
    ok = [{"rank": r, "node": r // 4, "local_rank": r % 4, "host": "h"} for r in range(8)]
    assert placement_problems(plan, ok) == []
    swapped = [dict(p, node=1 - p["node"]) for p in ok]
    problems = placement_problems(plan, swapped)
    assert len(problems) == 8 and "rank 0 runs on node 1" in problems[0]


def test_launch_rejects_what_the_runtime_cannot_place():
    from plan3d.errors import LaunchError
    from plan3d.run.launch import node_layout

    plan = make_plan(nodes=2, gpus_per_node=4, tp=2, pp=2, dp=2)
    with pytest.raises(LaunchError, match="need --nnodes 2"):
        node_layout(plan, 1, 0)
    with pytest.raises(LaunchError, match="outside 0..1"):
        node_layout(plan, 2, 2)


def test_diagnose_names_the_killed_rank(tmp_path):
    from plan3d.run.launch import diagnose

    log = ("Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
           "  rank      : 5 (local_rank: 5)\n  exitcode  : -9 (pid: 42)\n")
    assert diagnose(tmp_path, log) == (5, "rank 5 was killed by signal SIGKILL")


def test_diagnose_names_the_rank_without_a_record_when_a_timeout_came_first(tmp_path):
    import json

    from plan3d.run.launch import diagnose

    (tmp_path / "errors").mkdir()
    for rank, when in ((0, 3.0), (1, 1.0), (3, 2.0)):
        error = f"RuntimeError: Timed out waiting 5000ms for recv operation to complete (rank {rank})"
        (tmp_path / "errors" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "error": error, "time": when}))
    rank, message = diagnose(tmp_path, "", world=4)
    assert rank == 2 and message.startswith("rank 2 hung") and "first rank 1" in message
    (tmp_path / "errors" / "rank2.json").write_text(json.dumps({"rank": 2, "error": "ValueError: bad", "time": 0.5}))
    assert diagnose(tmp_path, "", world=4) == (2, "ValueError: bad")  # an error of its own came first


def test_dry_run_prints_exactly_the_commands_launch_runs(capsys, tmp_path):
    from plan3d.cli import main
    from plan3d.emit.torchrun import torchrun_commands
    from plan3d.run.launch import worker_argv

    run_dir = tmp_path / "r"
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "3", "--run-dir", str(run_dir), "--dry-run"])
    assert exit_info.value.code in (0, None)
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    args = worker_argv(run_dir, 3, "auto", ["--save-every", "0", "--timeout-s", "300.0", "--seed", "1234"])
    assert printed == [shlex.join(c) for c in torchrun_commands(str(run_dir / "plan.json"), 8, 1, 8, "127.0.0.1", 29500, args)]
    assert not run_dir.exists()


def test_launch_flags_with_an_impossible_layout_are_a_one_line_error(capsys):
    from plan3d.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--tp", "3", "--steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "tp=3" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_launch_ends_with_the_table_of_report(capsys, tmp_path, monkeypatch):
    """A real run of 2 ranks: `plan3d launch` ends with exactly what `plan3d report RUN_DIR` prints,
    and summary.json holds measurements only."""
    import json

    from plan3d.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    plan, run_dir = tmp_path / "plan.json", tmp_path / "run"
    for argv in (["recommend", "--cluster", "local-cpu", "--model", "tiny-gpt", "--tp", "1", "--pp", "1", "--dp", "2",
                  "--gpus-per-node", "2", "--precision", "fp32", "--top", "1", "--out", str(plan)],
                 ["launch", str(plan), "--steps", "3", "--run-dir", str(run_dir)],
                 ["report", str(run_dir)]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code in (0, None), capsys.readouterr()
        if argv[0] == "launch":
            launched = capsys.readouterr().out
    reported = capsys.readouterr().out
    assert launched.startswith("losses (steps 1..3)") and launched.endswith(reported)
    assert "measured vs predicted: tp1 pp1 dp2" in reported and "prediction error" in reported
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 3 and (run_dir / "logs" / "rank1.log").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "predicted" not in summary and summary["world_size"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_single_rank_bf16_runs(tmp_path):
    from runtime_helpers import run, summary

    from plan3d.cli.common import load_specs, make_layout
    from plan3d.plan import build_plan

    cluster, model, training = load_specs("h200", "tiny-gpt", 1, 1, None, None, "bf16")
    plan = build_plan(cluster, model, training, make_layout(), {})
    result = run(plan, tmp_path, steps=3, extra=["--no-save"], backend="nccl")
    assert result.ok, result.error
    done = summary(tmp_path)
    assert done["precision"] == "bf16" and done["backend"] == "nccl"
    from plan3d.cost.memory import model_state_bytes

    want = model_state_bytes(plan.model, plan.training, plan.layout, 0)
    got = done["ranks"][0]["model_state_bytes"]
    for kind in ("weights", "gradients", "optimizer"):
        assert abs(got[kind] - want[kind]) <= 0.01 * want[kind], kind


@pytest.mark.parametrize("bias, qkv_bias", [(False, True), (True, None), (False, None)])
def test_runtime_model_has_the_parameters_the_cost_model_counts(bias, qkv_bias):
    from plan3d.cost.params import total_params
    from plan3d.runtime.model import Stage
    from plan3d.runtime.tp import TPInfo

    model = make_plan().model.model_copy(update={"bias": bias, "qkv_bias": qkv_bias, "tied_embeddings": False})
    stage = Stage(model, TPInfo(1, 0, None, False), range(model.layers), first=True, last=True)
    assert sum(p.numel() for p in stage.parameters()) == total_params(model)


def test_token_file_batches_are_the_global_windows_cut_over_dp():
    """With --data each dp rank's rows are its slice of the token file's global batch."""
    import numpy as np

    from plan3d.runtime.data import replica_batch
    from plan3d.run.tokens import global_windows

    corpus = (np.arange(5000) * 7) % 256
    full = global_windows(corpus, seed=5, step=3, batch=8, seq=16)
    parts = [replica_batch(5, 3, 8, 16, 256, 4, d, corpus) for d in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), torch.from_numpy(full[:, :-1]))
    assert torch.equal(torch.cat([y for _, y in parts]), torch.from_numpy(full[:, 1:]))
    synthetic = replica_batch(5, 3, 8, 16, 256, 4, 0)[0]
    assert not torch.equal(synthetic, parts[0][0])


def _one_rank_context():
    """A ParallelContext of a single process (tp = pp = dp = 1): no process group is needed."""
    from plan3d.runtime.context import ParallelContext
    from plan3d.runtime.tp import TPInfo

    sizes = {"pp": 1, "dp": 1, "tp": 1}
    return ParallelContext(0, 1, None, {d: 0 for d in sizes}, torch.device("cpu"), TPInfo(1, 0, None, False),
                           None, sizes)


def _tiny_stage(layers: range, first: bool, last: bool, tied: bool = False):
    from plan3d.runtime.model import Stage, init_stage
    from plan3d.runtime.tp import TPInfo

    model, tp = make_plan().model.model_copy(update={"tied_embeddings": tied}), TPInfo(1, 0, None, False)
    stage = Stage(model, tp, layers, first=first, last=last)
    init_stage(stage, tp, seed=3, layers=model.layers)
    return stage


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_zero_engine_updates_like_plain_adam_on_one_rank(dtype, zero):
    """The one flat-buffer ZeRO-1/2 engine: two steps with known gradients (each accumulated over
    two backwards) give the fp32 weights and Adam moments of torch.optim.Adam on fp32 copies, and
    bf16 parameters are those weights rounded; its model-state bytes are the memory model's
    per-parameter figures (fp32 4 + 4 + 8, bf16 2 + 4 + 4 + 8)."""
    from plan3d.runtime.engine import collect_entries
    from plan3d.runtime.zero import FlatZeroDP

    ctx, lr = _one_rank_context(), 1e-2
    stage = _tiny_stage(range(2), first=True, last=True)
    entries = collect_entries([stage], ctx)
    reference = {e.name: e.param.detach().clone().requires_grad_() for e in entries}
    ref_opt = torch.optim.Adam(list(reference.values()), lr=lr)
    engine = FlatZeroDP(entries, ctx, "adam", lr, zero, param_dtype=dtype)
    assert all(e.param.dtype == dtype for e in entries)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        weights = {e.name: torch.randn(e.param.shape, generator=gen).to(dtype) for e in entries}
        engine.zero_grad()
        for _ in range(2):  # two micro-batches: the engine sums them in fp32
            sum((e.param * weights[e.name]).sum() for e in entries).backward()
        engine.reduce_grads()
        assert all(e.param.grad is None for e in entries), "gradients live in the engine's fp32 buffer"
        counted = sum((2 * weights[e.name].float()).pow(2).sum() for e in entries if e.counted)
        torch.testing.assert_close(engine.grad_sq_sum(), counted, rtol=1e-6, atol=0)
        engine.step()
        for e in entries:
            reference[e.name].grad = 2 * weights[e.name].float()
        ref_opt.step()
    state = engine.logical_state()
    for e in entries:
        want = reference[e.name].detach()
        torch.testing.assert_close(state[e.name]["param"], want, rtol=1e-6, atol=1e-7)
        assert torch.equal(e.param.detach(), state[e.name]["param"].to(dtype)), e.name
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[e.name][moment], ref_opt.state[reference[e.name]][moment],
                                       rtol=1e-6, atol=1e-9)
    n = sum(e.param.numel() for e in entries)
    master = 0 if dtype == torch.float32 else 4 * n
    assert engine.state_bytes() == {"weights": dtype.itemsize * n, "gradients": 4 * n, "optimizer": master + 8 * n}


def test_fsdp_rebinding_matches_parameters_by_name_not_position():
    """After wrapping, each entry takes the parameter of its own (logical) name, whatever order
    the stages list their parameters in; a stage set that lacks a name is refused."""
    from plan3d.runtime.engine import collect_entries, rebind_entries

    ctx = _one_rank_context()
    old = [_tiny_stage(range(2, 4), first=False, last=False), _tiny_stage(range(4, 8), first=False, last=True, tied=True)]
    entries = collect_entries(old, ctx)
    assert [e.name for e in entries if e.tied_copy] == ["embed.tok.weight"]
    new = [_tiny_stage(range(4, 8), first=False, last=True, tied=True), _tiny_stage(range(2, 4), first=False, last=False)]
    rebind_entries(entries, new)
    by_name = dict(new[1].named_parameters()) | dict(new[0].named_parameters())
    by_name["embed.tok.weight"] = by_name.pop("head.out.weight")
    assert all(e.param is by_name[e.name] for e in entries)
    with pytest.raises(RuntimeError, match="not the entries"):
        rebind_entries(entries, new[:1])


def _runtime_imports() -> dict[str, set[str]]:
    """{module: runtime modules it imports, at any level (function-level imports included)}."""
    import ast
    from pathlib import Path

    import plan3d.runtime

    package = Path(plan3d.runtime.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "plan3d.runtime":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plan3d.runtime."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("plan3d.runtime.")}
        graph[path.stem] = found
    return graph


def test_runtime_modules_import_one_way_and_no_private_names():
    """No import cycle inside plan3d/runtime (the data-parallel engines dp.py and zero.py, once
    dp.py and mixed.py, imported each other), and no module takes another's private names."""
    import ast
    from pathlib import Path

    import plan3d.runtime

    graph = _runtime_imports()
    assert {"dp", "zero", "engine"} <= set(graph) and "zero" in graph["dp"]
    assert "dp" not in graph["zero"] and not graph["engine"] & {"dp", "zero", "optim"}

    def cycle_from(module, path):
        for nxt in sorted(graph.get(module, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None

    cycles = [c for m in graph if (c := cycle_from(m, [m]))]
    assert not cycles, f"import cycle: {' -> '.join(cycles[0])}"
    private = [(p.name, a.name) for p in Path(plan3d.runtime.__file__).parent.glob("*.py")
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plan3d.runtime")
               for a in node.names if a.name.startswith("_")]
    assert not private, private
