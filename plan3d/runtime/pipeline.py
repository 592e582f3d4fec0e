"""Pipeline parallelism: stage assignment and the schedule of the layout.

Schedules are torch-native (`torch.distributed.pipelining`), the class the schedule table names
(bundled/pipeline_schedules.yaml `torch`: Schedule1F1B, Narayanan et al. 2021, arXiv:2104.04473
section 2.2; ScheduleInterleaved1F1B, same paper section 2.2.2; the zero-bubble and DualPipeV
schedules where the runtime's profile lists them). Stage modules are built by hand
(`model.Stage`), not traced: virtual stage k*pp + r lives on pipeline rank r (stages r and
2pp - 1 - r under a V-shaped schedule) and holds the layers the layout's `stage_layers` gives it
(uneven splits included). Shapes are passed
statically, so no metadata exchange or shape inference runs inside tensor-parallel stages.
With pp == 1 there is no schedule: micro-batches are accumulated in a plain loop.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from plan3d.runtime.context import ParallelContext
from plan3d.specs import schedule as schedules
from plan3d.runtime.model import Stage, init_stage
from plan3d.runtime.tp import cross_entropy


def stage_ranges(plan) -> list[range]:
    """Layer range of every virtual stage, in pipeline order."""
    counts = plan.layout.stage_layers(plan.model.layers)
    ends = list(accumulate(counts))
    return [range(end - n, end) for n, end in zip(counts, ends)]


def my_stage_ids(plan, pp_rank: int) -> list[int]:
    """The virtual stages pipeline rank `pp_rank` runs, as the layout's schedule places them."""
    layout = plan.layout
    return [s for s in range(layout.pp * layout.vpp) if layout.rank_of_stage(s) == pp_rank]


def build_stages(plan, ctx: ParallelContext, seed: int, amp_dtype=None) -> tuple[list[Stage], list[int]]:
    """This rank's stage modules (initialised layout-independently) and their stage ids."""
    ranges, ids = stage_ranges(plan), my_stage_ids(plan, ctx.local("pp"))
    stages = []
    for sid in ids:
        stage = Stage(plan.model, ctx.tp, ranges[sid], first=sid == 0, last=sid == len(ranges) - 1,
                      recompute=plan.layout.recompute, amp_dtype=amp_dtype, cp=ctx.cp, ep=ctx.ep)
        init_stage(stage, ctx.tp, seed, plan.model.layers)
        stages.append(stage.to(ctx.device))
    return stages, ids


def _io_shapes(plan, ctx: ParallelContext, sid: int, seq: int, dtype):
    """Static (input, output) meta tensors of virtual stage `sid` for one micro-batch."""
    mb, hidden = plan.layout.micro_batch, plan.model.hidden
    local_seq = seq // ctx.tp.size if ctx.tp.sequence_parallel else seq
    act = torch.empty(mb, local_seq, hidden, device="meta", dtype=dtype, requires_grad=True)
    inp = torch.empty(mb, seq, dtype=torch.long, device="meta") if sid == 0 else act
    last = sid == plan.layout.pp * plan.layout.vpp - 1
    out = torch.empty(mb, seq, plan.model.vocab // ctx.tp.size, device="meta", dtype=dtype,
                      requires_grad=True) if last else act
    return inp, out


def make_schedule(plan, ctx: ParallelContext, stages, ids, seq: int, n_micro: int,
                  dtype=torch.float32, scale_grads: bool = True):
    """The native schedule for this rank, or None when pp == 1. `seq`: the tokens of a sequence
    this rank holds (seq / cp under context parallelism). `scale_grads=False` when the
    gradients live outside `param.grad` (mixed precision) and are divided by the engine."""
    if plan.layout.pp == 1:
        return None
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    total = plan.layout.pp * plan.layout.vpp
    pipe_stages = []
    for stage, sid in zip(stages, ids):
        inp, out = _io_shapes(plan, ctx, sid, seq, dtype)
        pipe_stages.append(PipelineStage(stage, sid, total, ctx.device, input_args=inp, output_args=out,
                                         group=ctx.group("pp")))

    def loss_fn(output, target):
        return cross_entropy(output, target, ctx.tp)

    schedule = get_schedule_class(schedules.schedules()[plan.layout.pipeline_schedule].torch)
    if issubclass(schedule, PipelineScheduleSingle):
        return schedule(pipe_stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=scale_grads)
    return schedule(pipe_stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=scale_grads)


def forward_backward(schedule, stages, ids, ctx: ParallelContext, inputs, targets, n_micro: int,
                     total_stages: int) -> torch.Tensor | None:
    """One step's forward and backward; returns this replica's mean loss where it is known."""
    if schedule is None:
        losses, stage = [], stages[0]
        for i, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
            if hasattr(stage, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once, at the end
                stage.set_requires_gradient_sync(i == n_micro - 1)
            loss = cross_entropy(stage(x), y, ctx.tp)
            (loss / n_micro).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()
    has_first, has_last = 0 in ids, total_stages - 1 in ids
    losses: list = []
    args = (inputs,) if has_first else ()
    schedule.step(*args, target=targets if has_last else None, losses=losses if has_last else None)
    return torch.stack([l.detach() for l in losses]).mean() if has_last else None
