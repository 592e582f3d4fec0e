"""torchrun command lines: one launcher per node, static rendezvous (node order = the plan's).

torchrun's c10d rendezvous assigns node ranks in arrival order, which can disagree with the
plan's rank map; the static rendezvous (`--rdzv-backend static --node-rank N`) makes global rank
= node_rank * nproc_per_node + local_rank, the placement the rank map assumes.
`--rdzv-conf=timeout=T` bounds the rendezvous by the launch timeout: node 0 waits at most T s for
the other nodes (torchrun's default is 600 s, then a 300 s exit barrier), a node at most T s for
node 0.
"""
from __future__ import annotations

import math
import sys

WORKER_MODULE = "plan3d.runtime.worker"


def torchrun_commands(plan_path: str, world: int, nnodes: int, gpus_per_node: int,
                      master_addr: str, master_port: int, worker_args: list[str] | tuple[str, ...] = (),
                      worker_module: str = WORKER_MODULE, python: str | None = None,
                      rdzv_timeout_s: float = 300.0) -> list[list[str]]:
    """argv of every node's launcher, in node order."""
    nproc = min(world, gpus_per_node)
    return [node_command(plan_path, nnodes, nproc, node, master_addr, master_port, worker_args,
                         worker_module, python, rdzv_timeout_s) for node in range(nnodes)]


def node_command(plan_path: str, nnodes: int, nproc: int, node_rank: int, master_addr: str,
                 master_port: int, worker_args=(), worker_module: str = WORKER_MODULE,
                 python: str | None = None, rdzv_timeout_s: float = 300.0) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
            "--rdzv-backend=static", f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--rdzv-conf=timeout={max(1, math.ceil(rdzv_timeout_s))}",
            "--max-restarts=0", "-m", worker_module, "--plan", str(plan_path), *map(str, worker_args)]
