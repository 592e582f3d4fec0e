"""The training loop of one rank: set-up from the plan, steps, metrics, checkpoints, summary."""
from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plan3d.errors import LaunchError
from plan3d.runtime import history, memory
from plan3d.runtime.clip import clip_global_norm
from plan3d.runtime.context import build_context, check_placement
from plan3d.runtime.cp import check_seq, split_sequence
from plan3d.runtime.data import replica_batch
from plan3d.runtime.dp import make_dp, shard_stages
from plan3d.runtime.engine import collect_entries, rebind_entries
from plan3d.runtime.pipeline import build_stages, forward_backward, make_schedule
from plan3d.run.tokens import map_tokens, token_file_record

SYNTHETIC = {"path": None, "tokens": None, "format": "synthetic"}  # summary.json's `data` without --data


def _device_and_backend(choice: str) -> tuple[torch.device, str]:
    import os

    cuda = torch.cuda.is_available() and choice != "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        from plan3d.errors import LaunchError
        raise LaunchError("--backend nccl needs CUDA GPUs; use --backend gloo (CPU) on this machine")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    torch.set_num_threads(1)
    return torch.device("cpu"), "gloo"


def run_precision(plan, device: torch.device, choice: str = "auto") -> tuple[str, torch.dtype | None]:
    """auto: fp32 on CPU, bf16 mixed on GPU unless the plan says fp32; or forced by --precision."""
    if choice == "auto":
        choice = "fp32" if device.type == "cpu" or plan.training.precision == "fp32" else "bf16"
    return (choice, torch.bfloat16) if choice == "bf16" else ("fp32", None)


class PhaseClock:
    """Wall time of the phases of one step on this rank (the device synchronised at each mark,
    so a phase holds its own kernels): forward_backward (compute, TP and PP traffic, bubble),
    grad_reduce (model-parallel and DP gradient reduction), clip (global-norm all-reduce),
    optimizer (update, and the ZeRO 1/2 all-gather), loss (the logged loss all-reduce)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now

    def elapsed(self) -> float:
        return self.last - self.start


def _read_plan(path: str):
    """The plan the launcher wrote (and checked with load_plan); no second digest check here, so
    the ranks do not depend on the spec schema being byte-identical to the launcher's. What the
    runtime cannot train is refused here too (`plan3d.run.limits.runtime_problems`): the torchrun and SLURM
    scripts `plan3d emit` writes start the workers without `plan3d launch`."""
    from plan3d.run.limits import runtime_problems
    from plan3d.plan import Plan

    plan = Plan.model_validate_json(Path(path).read_text())
    problems = runtime_problems(plan)
    if problems:
        raise LaunchError("; ".join(problems))
    return plan


class Runner:
    """Everything one rank holds for a run (no module-level state)."""

    def __init__(self, args, run_dir: Path, rank: int):
        self.args, self.run_dir, self.rank = args, run_dir, rank
        self.plan = _read_plan(args.plan)
        self.device, backend = _device_and_backend(args.backend)
        timeout = timedelta(seconds=args.timeout_s)
        dist.init_process_group(backend, timeout=timeout)
        check_placement(self.plan)
        self.ctx = build_context(self.plan, self.device, timeout)
        self.precision, amp = run_precision(self.plan, self.device, args.precision)
        layout, training = self.plan.layout, self.plan.training
        self.seq = training.seq_len or self.plan.model.seq_len
        check_seq(self.seq, layout.cp)
        self.stages, self.ids = build_stages(self.plan, self.ctx, args.seed, amp)
        entries = collect_entries(self.stages, self.ctx)
        if args.compile:
            for block in (b for stage in self.stages for b in stage.layers.values()):
                block.compile()
        if layout.zero == 3:
            shard_stages(self.stages, self.ctx, amp)
            rebind_entries(entries, self.stages)
        self.n_micro = layout.micro_batches(training.global_batch)
        self.engine = make_dp(entries, self.ctx, layout.zero, training.optimizer, args.lr, amp,
                              pipeline_micro_batches=self.n_micro if layout.pp > 1 else 1)
        self.schedule = make_schedule(self.plan, self.ctx, self.stages, self.ids, self.seq // layout.cp, self.n_micro,
                                      amp or torch.float32, scale_grads=not self.engine.collects_grads)
        self.state_bytes: dict = {}
        self.tokens = map_tokens(args.data, self.seq + 1) if args.data else None  # checked by the launcher
        self.data_record = token_file_record(args.data) if args.data else SYNTHETIC

    def batch(self, step: int):
        """(inputs, targets) of this rank: its dp replica's rows, and under context parallelism
        its cp rank's two chunks of each sequence (runtime/cp.py)."""
        t = self.plan.training
        rows = replica_batch(self.args.seed, step, t.global_batch, self.seq, self.plan.model.vocab,
                             self.plan.layout.dp, self.ctx.local("dp"), self.tokens)
        return tuple(split_sequence(x, self.ctx.cp.size, self.ctx.cp.rank) for x in rows)

    def step(self, step: int) -> dict:
        clock = PhaseClock(self.device)
        self.engine.zero_grad()
        inputs, targets = (t.to(self.device) for t in self.batch(step))
        total = self.plan.layout.pp * self.plan.layout.vpp
        loss = forward_backward(self.schedule, self.stages, self.ids, self.ctx, inputs, targets,
                                self.n_micro, total)
        clock.mark("forward_backward")
        self.engine.reduce_grads()
        clock.mark("grad_reduce")
        norm = clip_global_norm(self.engine, self.args.clip)
        clock.mark("clip")
        self.engine.step()
        clock.mark("optimizer")
        global_loss = self._global_loss(loss)
        clock.mark("loss")
        elapsed = clock.elapsed()
        tokens = self.plan.training.global_batch * self.seq
        return {"step": step, "loss": global_loss, "grad_norm": norm, "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed, "phases_s": clock.phases}

    def _global_loss(self, loss) -> float:
        """Mean loss over the global batch, known on every rank (one all-reduce); each cp rank's
        loss is the mean over its equal share of every sequence's tokens."""
        mine = torch.zeros(1, device=self.device, dtype=torch.float64)
        if loss is not None and self.ctx.tp.rank == 0:
            mine += loss.double() / (self.plan.layout.dp * self.plan.layout.cp)
        dist.all_reduce(mine)
        return float(mine)

    def save(self, step: int, written=None) -> None:
        meta = {"layout": self.plan.layout.model_dump(mode="json"), "digest": self.plan.digest,
                "seed": self.args.seed}
        from plan3d.runtime import checkpoint  # DCP imports DTensor (~2 s): only when saving

        checkpoint.save(self.run_dir / "checkpoints", step, self.engine, self.ctx, meta, written,
                        keep_last=self.args.keep_last)

    def resume(self) -> int:
        if not self.args.resume_from:
            return 0
        from plan3d.runtime import checkpoint

        meta = checkpoint.load(Path(self.args.resume_from), self.engine, self.ctx)
        return int(meta["step"])


def _append(path: Path, record: dict) -> None:
    """One strict-JSON line (a non-finite value raises instead of writing a bare NaN)."""
    line = json.dumps(record, allow_nan=False)
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()


class NonFiniteLoss(LaunchError):
    """The loss or gradient norm of a step is NaN or infinite: the run stops before it writes
    the step's metrics or a checkpoint (one message, the same on every rank)."""


def check_finite(record: dict, last_saved: str | None) -> None:
    bad = [name for name in ("loss", "grad_norm") if not math.isfinite(record[name])]
    if bad:
        where = (f"the last checkpoint, {last_saved}, predates it" if last_saved else
                 "no checkpoint was written")
        raise NonFiniteLoss(f"the {' and '.join(bad)} became {record[bad[0]]} at step {record['step']}; "
                            f"stopped before saving ({where}); lower the learning rate or check the data "
                            "and resume from an earlier checkpoint")


def _poison(runner: "Runner") -> None:
    """Testing (--fail-mode nan): this rank's weights become NaN, so the next loss is NaN."""
    with torch.no_grad():
        for stage in runner.stages:
            for param in stage.parameters():
                param.fill_(float("nan"))


def _segment_record(runner: Runner, start_step: int) -> dict:
    """What segments.jsonl keeps of this launch (runtime/history.py); timing comes from its steps.
    Measurements and identities only: `plan3d report` predicts from the plan `plan_digest` names."""
    args, plan = runner.args, runner.plan
    return {"first_step": start_step + 1, "target_step": args.steps, "resumed_at_step": start_step,
            "resumed_from": str(args.resume_from) if args.resume_from else None,
            "layout": plan.layout.short(), "world_size": runner.ctx.world, "precision": runner.precision,
            "backend": dist.get_backend(), "warmup_steps": args.warmup_steps, "data": runner.data_record,
            "plan_digest": plan.digest, "started_at": time.time()}


def _summary(runner: Runner, records: list[dict], peaks: list, start_step: int) -> dict:
    """The whole run (every step of metrics.jsonl, every segment) and this launch's layout,
    timing and memory: measurements only (plan3d/run/record.py); `plan3d report` pairs them with
    the plan's predictions (plan3d/run/compare.py)."""
    args, plan = runner.args, runner.plan
    every = history.read_metrics(runner.run_dir)
    timed = records[args.warmup_steps:] or records
    return {
        "world_size": runner.ctx.world, "layout": plan.layout.model_dump(mode="json"),
        "precision": runner.precision, "backend": dist.get_backend(), "steps": len(every),
        "first_step": every[0]["step"] if every else start_step + 1, "warmup_steps": min(args.warmup_steps, len(records)),
        "step_time_s": sum(r["step_time_s"] for r in timed) / max(1, len(timed)),
        "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / max(1, len(timed)),
        "final_loss": every[-1]["loss"] if every else None,
        "losses": [r["loss"] for r in every],
        "data": runner.data_record,
        "segments": history.summarize_segments(history.read_segments(runner.run_dir), every),
        "ranks": peaks,
        "phases_s": {k: sum(r["phases_s"][k] for r in timed) / len(timed) for k in (timed[0]["phases_s"] if timed else {})},
    }


def _mesh_groups(ctx) -> dict[str, list[int]]:
    """This rank's group of every mesh dimension (and of dp x cp when cp > 1, ep and edp with MoE
    layers), as global ranks."""
    dims = ("tp", "dp", "pp") + (("cp", "dp_cp") if ctx.cp.size > 1 else ())
    groups = {d: dist.get_process_group_ranks(ctx.group(d)) for d in dims}
    if ctx.expert_mesh is not None:
        groups.update({d: dist.get_process_group_ranks(ctx.expert_mesh.get_group(d)) for d in ("ep", "edp")})
    return groups


def train(args, run_dir: Path, rank: int, inject) -> None:
    runner = Runner(args, run_dir, rank)
    start_step = runner.resume()
    records, metrics = [], run_dir / "metrics.jsonl"
    if rank == 0:
        history.inherit(run_dir, args.resume_from, start_step)
        history.rewind(run_dir, start_step)
        history.start_segment(run_dir, _segment_record(runner, start_step))
    last_saved = None
    for step in range(start_step + 1, args.steps + 1):
        record = runner.step(step)
        check_finite(record, last_saved)
        if not runner.state_bytes:
            runner.state_bytes = memory.model_state(runner.engine)
        records.append(record)
        if rank == 0:
            _append(metrics, record)
        in_save = args.fail_mode == "kill-during-save"
        if not in_save:
            inject(args, rank, step)
        if not args.no_save and ((args.save_every and step % args.save_every == 0) or step == args.steps):
            runner.save(step, (lambda: inject(args, rank, step)) if in_save else None)
            last_saved = f"step {step}"
        if args.fail_mode == "nan" and (step, rank) == (args.fail_at_step, args.fail_rank):
            _poison(runner)
    mine = {"rank": rank, "model_state_bytes": runner.state_bytes, "peak_memory_bytes": memory.peak_bytes(runner.device),
            "pp": runner.ctx.local("pp"), "dp": runner.ctx.local("dp"), "tp": runner.ctx.local("tp"),
            "cp": runner.ctx.cp.rank, "cp_comm": runner.ctx.cp.comm, "mesh_groups": _mesh_groups(runner.ctx)}
    peaks: list = [None] * runner.ctx.world
    dist.all_gather_object(peaks, mine)
    if rank == 0:
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(_summary(runner, records, peaks, start_step), indent=1, allow_nan=False))
        tmp.replace(run_dir / "summary.json")
    dist.barrier()
    dist.destroy_process_group()
