"""Search speed of `plan3d recommend` (issue 5): layouts per second and wall time.

Prints three tables:
1. the two headline cases, searched in-process (best of --repeat runs: the least disturbed by
   other load): layouts considered (every knob combination of the space), valid ones (sent to the
   vectorised cost model), feasible ones, wall and CPU ms, layouts/s and valid layouts/s; plus the
   405B case with uneven layer splits (one run). These in-process searches have no engine, so
   their splits are even unless asked;
2. the same cases and DeepSeek-V3 on 1,024 H100 through the real command (`plan3d recommend --json`, the default engine
   megatron-core, which searches uneven splits by default: issue 29) in a fresh process pinned
   to one core (`taskset -c 0` when available): wall time including interpreter and import start-up;
3. a sweep of cluster sizes from 8 to 32,768 GPUs (DGX H100 nodes, GPT-3 175B) showing how the
   cost grows with the number of factorizations.

    .venv/bin/python benchmarks/search_speed.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from plan3d.search import Space, search
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec

CASES = [  # label, cluster, nodes, model
    ("GPT-3 175B on 512 A100 (seed)", "dgx-a100-80g", 64, "gpt3-175b"),
    ("Llama-3 405B on 16,384 H100", "dgx-h100", 2048, "llama3-405b"),
]
COMMAND_CASES = CASES + [("DeepSeek-V3 on 1,024 H100", "dgx-h100", 128, "deepseek-v3")]
TARGET_S = {"Llama-3 405B on 16,384 H100": 1.0, "DeepSeek-V3 on 1,024 H100": 5.0}  # issue 29's bars
SWEEP_NODES = (1, 4, 16, 64, 256, 1024, 2048, 4096)


def timed_search(cluster_name: str, nodes: int, model_name: str, repeat: int, space: Space = Space()):
    cluster, model = load_cluster(cluster_name, nodes), load_model(model_name)
    training = TrainingSpec(global_batch=model.default_global_batch)
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = search(cluster, model, training, space)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    return result, min(walls), min(cpus)


def row(label: str, result, wall_s: float, cpu_s: float) -> str:
    """Rates use the wall time (the conservative one on a busy machine)."""
    return (f"| {label} | {result.cluster.world_size:,} | {result.considered:,} | {result.size:,} | "
            f"{result.feasible_count:,} | {wall_s * 1e3:.1f} | {cpu_s * 1e3:.1f} | {result.considered / wall_s:,.0f} | "
            f"{result.size / wall_s:,.0f} |")


HEADER = ("| case | GPUs | layouts considered | valid (evaluated) | feasible | search ms | CPU ms | layouts/s | "
          "evaluated/s |\n|---|---|---|---|---|---|---|---|---|")


def cli_wall(cluster_name: str, nodes: int, model_name: str, repeat: int) -> tuple[float, float]:
    """Best wall and CPU (user + sys) seconds of the command in a fresh process."""
    plan3d = Path(sys.executable).with_name("plan3d")
    cmd = [str(plan3d), "recommend", "--cluster", cluster_name, "--nodes", str(nodes), "--model", model_name, "--json"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0"] + cmd
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    print("in-process search, best (minimum) of", repeat, "runs\n" + HEADER)
    for label, cluster, nodes, model in CASES:
        print(row(label, *timed_search(cluster, nodes, model, repeat)))
    label, cluster, nodes, model = CASES[1]
    print(row(label + ", uneven splits", *timed_search(cluster, nodes, model, 1, Space(uneven=True))))
    print("\nthe command (engine megatron-core: uneven splits searched), fresh process, one core (includes "
          "start-up; CPU = user + sys, which a busy machine does not inflate)\n| case | wall s | CPU s | target |\n"
          "|---|---|---|---|")
    for label, cluster, nodes, model in COMMAND_CASES:
        wall, cpu = cli_wall(cluster, nodes, model, repeat)
        bar = f"< {TARGET_S[label]:g} s: {'met' if wall < TARGET_S[label] else 'MISSED'}" if label in TARGET_S else "-"
        print(f"| {label} | {wall:.3f} | {cpu:.3f} | {bar} |")
    print("\ncluster-size sweep: GPT-3 175B on DGX H100 nodes\n" + HEADER)
    for nodes in SWEEP_NODES:
        print(row(f"{nodes} nodes", *timed_search("dgx-h100", nodes, "gpt3-175b", repeat)))


if __name__ == "__main__":
    main()
