"""Calibration micro-benchmarks, run on every rank: GEMMs of a transformer layer, collectives by size.

Started like a training worker, by `plan3d.run.launch.launch(..., worker_module=
"plan3d.runtime.calibrate_worker")` (torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT),
or, for development and tests, by `run_local` (torch.multiprocessing, one machine). It reads a sweep description (JSON, written by
`plan3d calibrate`, see `plan3d.cli.calibrate_cmd.sweep_config`) and rank 0 writes the raw
measurements that `plan3d.calibrate` fits.

Every rank runs every GEMM at the same time (barrier, then time), so the measured throughput is the
throughput a rank gets while its neighbours compute too: on CPU the cores are shared exactly as in
a launch, on GPUs the ranks are independent. Collectives run over concurrent disjoint groups (all
groups of one kind at once), which is how data/tensor-parallel groups load a fabric. Point-to-point
is a ping-pong between the two members of each pair; half the round trip is one transfer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

PROGRESS_FILE = "progress"
# Seconds each timing should last. On a shared CPU the processes must overlap for long enough that
# the OS scheduler shares the cores as it does in a launch (short windows run one rank at a time).
TARGET_S = [0.005]
# "median" of the timings, or "min" (best of N: rejects interference from other processes on a
# shared machine, as long as the interference comes and goes).
STATISTIC = ["median"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int, target_s: float) -> float:
    """Median seconds of one `fn()` call: `repeats` timings, each of `inner` back-to-back calls
    after a barrier (all ranks start together). `inner` is the same on every rank (the largest
    any rank asks for), so a collective inside `fn` matches up."""
    fn()  # warm-up: allocator, first-call overheads, lazily created communicators
    start = time.perf_counter()
    fn()
    _sync(device)
    once_s = max(time.perf_counter() - start, 1e-7)
    wanted = torch.tensor([min(2000, max(1, int(target_s / once_s)))], dtype=torch.int64)
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
    inner, times = int(wanted.item()), []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / inner)
    return min(times) if STATISTIC[0] == "min" else statistics.median(times)


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def gemm_sweep(gemms: list[dict], dtype: torch.dtype, device: torch.device, repeats: int, progress) -> list[dict]:
    """Time batch x (m, k) @ (k, n) for each shape; FLOPs = 2 * batch * m * n * k."""
    out = []
    for shape in gemms:
        a = torch.randn(shape["batch"], shape["m"], shape["k"], dtype=dtype, device=device)
        b = torch.randn(shape["batch"], shape["k"], shape["n"], dtype=dtype, device=device)
        time_s = _mean_over_ranks(_timed(lambda: torch.bmm(a, b), device, repeats, TARGET_S[0]))
        flops = 2.0 * shape["batch"] * shape["m"] * shape["n"] * shape["k"]
        out.append({**shape, "flops": flops, "time_s": time_s})
        progress()
    return out


def elementwise_sweep(sizes: list[int], dtype: torch.dtype, device: torch.device, repeats: int,
                      progress) -> list[dict]:
    """Time a memory-bound kernel (GELU: read one element, write one) per activation size."""
    out = []
    for numel in sizes:
        x = torch.randn(numel, dtype=dtype, device=device)
        time_s = _mean_over_ranks(_timed(lambda: torch.nn.functional.gelu(x), device, repeats, TARGET_S[0]))
        out.append({"elements": numel, "bytes": 2 * numel * x.element_size(), "time_s": time_s})
        progress()
    return out


def layer_overhead_probe(probe: dict, device: torch.device, repeats: int, progress) -> dict:
    """Forward + backward of one runtime `Block` so small that its FLOPs and bytes are negligible:
    what is left is the framework's fixed cost per layer (dispatch, autograd, kernel launches)."""
    from plan3d.runtime.model import Block
    from plan3d.runtime.tp import TPInfo
    from plan3d.specs.model import ModelSpec

    spec = ModelSpec.model_validate(probe["model"])
    block = Block(spec, TPInfo(1, 0, None, False), "none").to(device)
    x = torch.randn(probe["micro_batch"], spec.seq_len, spec.hidden, device=device, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    time_s = _mean_over_ranks(_timed(step, device, repeats, TARGET_S[0]))
    progress()
    return {"model": probe["model"], "micro_batch": probe["micro_batch"], "forward_backward_s": time_s}


def _exchange(buffer: torch.Tensor, members: list[int]):
    """Both members of a pair send `buffer` to each other at once, as pipeline stages do
    (`batch_isend_irecv`, what torch.distributed.pipelining issues): one transfer each way."""
    me = dist.get_rank()
    if me not in members[:2]:
        return lambda: None
    peer = members[1] if me == members[0] else members[0]
    inbox = torch.empty_like(buffer)

    def run() -> None:
        ops = [dist.P2POp(dist.isend, buffer, peer), dist.P2POp(dist.irecv, inbox, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return run


def _collective(op: str, size_bytes: int, group, group_size: int, members: list[int], device: torch.device):
    """A closure that runs one collective of `size_bytes` (the full, gathered size) on `group`."""
    numel = max(group_size, size_bytes // 4 // group_size * group_size)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(numel // group_size, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    return _ping_pong(full, members)


def _ping_pong(buffer: torch.Tensor, members: list[int]):
    me, (first, second) = dist.get_rank(), members[:2]
    if me == first:
        return lambda: (dist.send(buffer, second), dist.recv(buffer, second))
    if me == second:
        return lambda: (dist.recv(buffer, first), dist.send(buffer, first))
    return lambda: None


def _between_collectives_work(config: dict, device: torch.device):
    """The work a rank does between two collectives of a training step, or None.

    In a step, collectives are separated by a sublayer of framework work (dispatch, autograd,
    small kernels). On a CPU where ranks outnumber cores, a rank that was computing must wait for
    its partners to be scheduled again, so a collective costs more inside a step than back to
    back (measured here: 2-rank all-reduce of 16 KiB under 8 ranks on 2 cores, 2.8 ms back to
    back, 3.4-4.9 ms between bursts of work). With `in_step` set, every collective is preceded by
    the forward of the overhead probe's block, and the time of that work alone is subtracted."""
    probe = config.get("overhead_probe")
    if not config.get("in_step") or not probe:
        return None
    from plan3d.runtime.model import Block
    from plan3d.runtime.tp import TPInfo
    from plan3d.specs.model import ModelSpec

    spec = ModelSpec.model_validate(probe["model"])
    block = Block(spec, TPInfo(1, 0, None, False), "none").to(device)
    x = torch.randn(probe["micro_batch"], spec.seq_len, spec.hidden, device=device, requires_grad=True)
    return lambda: block(x)


def collective_sweep(config: dict, device: torch.device, repeats: int, progress) -> list[dict]:
    out = []
    work = _between_collectives_work(config, device)
    work_s = _timed(work, device, repeats, TARGET_S[0]) if work else 0.0
    for kind in config["groups"]:
        groups = [dist.new_group(members, timeout=collective_timeout(config))  # every rank creates every group
                  for members in kind["members"]]
        mine = next(((g, m) for g, m in zip(groups, kind["members"]) if dist.get_rank() in m), None)
        n = len(kind["members"][0])
        for op in config["ops"]:
            if op == "p2p" and n != 2:
                continue
            for size in config["sizes_bytes"]:
                run = (_collective(op, size, mine[0], n, mine[1], device) if mine else (lambda: None))
                if work is not None:
                    if op == "p2p":
                        run = _exchange(torch.ones(max(1, size // 4), device=device), mine[1]) if mine else run
                    time_s = max(_timed(lambda: (work(), run()), device, repeats, TARGET_S[0]) - work_s, 1e-7)
                else:
                    time_s = _timed(run, device, repeats, TARGET_S[0]) / (2 if op == "p2p" else 1)
                out.append({"op": op, "tier": kind["tier"], "group_size": n, "bytes": size, "in_step": work is not None,
                            "time_s": _mean_over_ranks(time_s if mine else 0.0) * dist.get_world_size()
                            / _ranks_in(kind)})
                progress()
    return out


def _ranks_in(kind: dict) -> int:
    return sum(len(m) for m in kind["members"])


def run_sweep(config: dict, out_dir: Path) -> dict | None:
    """The whole sweep on this rank (process group already initialised); rank 0 returns the record."""
    device = torch.device(config.get("device", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    total = (len(config["gemms"]) + len(config.get("elementwise", [])) + _collective_count(config)
             + int("overhead_probe" in config))
    done = [0]

    def progress() -> None:
        done[0] += 1
        if dist.get_rank() == 0:
            (out_dir / PROGRESS_FILE).write_text(f"{done[0]} {total}\n")

    repeats = config.get("repeats", 5)
    TARGET_S[0] = config.get("target_s", 0.1 if device.type == "cpu" else 0.005)
    STATISTIC[0] = config.get("statistic", "median")
    gemms = gemm_sweep(config["gemms"], dtype, device, repeats, progress)
    elementwise = elementwise_sweep(config.get("elementwise", []), dtype, device, repeats, progress)
    probe = config.get("overhead_probe")
    overhead = layer_overhead_probe(probe, device, repeats, progress) if probe else None
    collectives = collective_sweep(config, device, repeats, progress)
    if dist.get_rank() != 0:
        return None
    return {"device": device.type, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
            "torch_dtype": config.get("torch_dtype", "float32"), "threads": torch.get_num_threads(),
            "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "gemm": gemms, "elementwise": elementwise, "collectives": collectives, "layer_overhead": overhead}


def _collective_count(config: dict) -> int:
    per_kind = [sum(1 for op in config["ops"] if op != "p2p" or len(k["members"][0]) == 2) for k in config["groups"]]
    return sum(per_kind) * len(config["sizes_bytes"])


DEFAULT_TIMEOUT_S = 300.0  # a rank that hangs ends the sweep after this long, not torch's 30 minutes


def collective_timeout(config: dict) -> timedelta:
    """The sweep's collective timeout (`timeout_s` in the sweep file), for the world and every subgroup."""
    return timedelta(seconds=float(config.get("timeout_s", DEFAULT_TIMEOUT_S)))


def _worker(config: dict, out_dir: Path, backend: str) -> None:
    dist.init_process_group(backend, timeout=collective_timeout(config))
    try:
        if config.get("threads"):
            torch.set_num_threads(config["threads"])
        record = run_sweep(config, out_dir)
        if record is not None:
            (out_dir / "calibration.json").write_text(json.dumps(record, indent=1, allow_nan=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, config: dict, out_dir: str, backend: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _worker(config, Path(out_dir), backend)


def run_local(config: dict, world_size: int, out_dir: Path, backend: str = "gloo", port: int | None = None) -> dict:
    """Run the sweep on this machine with `world_size` processes; return rank 0's record."""
    import socket

    import torch.multiprocessing as mp

    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    mp.start_processes(_spawned, args=(world_size, port, config, str(out_dir), backend), nprocs=world_size,
                       join=True, start_method="fork")  # fork: no __main__ guard needed in the caller
    return json.loads((out_dir / "calibration.json").read_text())


def main(argv: list[str] | None = None) -> None:
    """Entry point under the launcher: `python -m plan3d.runtime.calibrate_worker --plan P --run-dir D
    --backend B --sweep S` (the launcher adds --plan, --run-dir, --steps, --backend; `plan3d calibrate`
    adds --sweep through worker_args). Rank 0 writes D/calibration.json."""
    parser = argparse.ArgumentParser(prog="plan3d.runtime.calibrate_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", required=True, help="sweep description (JSON file)")
    parser.add_argument("--run-dir", "--out", dest="out", required=True, help="where calibration.json goes")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args, _unknown = parser.parse_known_args(argv)  # --plan, --steps: the launcher's, unused here
    config = json.loads(Path(args.sweep).read_text())
    backend = args.backend if args.backend != "auto" else ("nccl" if config.get("device") == "cuda" else "gloo")
    _worker(config, Path(args.out), backend)


if __name__ == "__main__":
    main()
