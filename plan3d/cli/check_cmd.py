"""`plan3d check JOB.yaml`: the CI gate. Exit 0 valid and fits, 1 would not fit / violates a
constraint, 2 the file itself is invalid (issue 5).

Every problem of an invalid file is reported in one run, each once, with its field and line
(`plan3d.job.read_job`; issue 30); the layout and fit checks run once the file is valid."""
from __future__ import annotations

from typing import Annotated

import typer

from plan3d.cli.app import app
from plan3d.cli.common import EngineOpt, GpuMemoryOpt
from plan3d.cli.recommend_cmd import MaxMemFracOpt, MinMfuOpt, _thresholds
from plan3d.errors import EXIT_BAD_INPUT, EXIT_FAILED, Plan3dError, SpecError
from plan3d.job import JobProblem, read_job
from plan3d.ranking import Finding, check_job
from plan3d.render import check as render
from plan3d.render.units import json_text
from plan3d.specs.catalog import load_cluster, load_engine, with_gpu_memory

FORMATS = ("text", "github")
UNCHECKED = "the layout and its fit are checked once the file is valid"


@app.command("check")
def check(
    job_file: Annotated[str, typer.Argument(help="Job file: cluster, model, training and layout (YAML or JSON).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="text, or github (workflow annotations).")] = "text",
    min_mfu: MinMfuOpt = None,
    max_memory_fraction: MaxMemFracOpt = None,
    engine: EngineOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Also fail a layout that leaves some of the job's GPUs idle (a warning otherwise).")] = False,
    conservative: Annotated[bool, typer.Option(
        "--conservative", help="Judge --min-mfu at the slow end of the prediction's error band (80% of published "
        "runs like it measured no slower).")] = False,
) -> None:
    """Validate a job file for CI: valid, runs on its engine, fits in memory with headroom, meets the thresholds.

    --engine overrides the job file's `engine:` (default megatron-core; plan3d-runtime on CPU clusters),
    --gpu-memory the memory of its cluster's GPUs (GiB)."""
    if fmt not in FORMATS:
        raise SpecError("command line", [f"--format {fmt!r}: use text or github"])
    thresholds = _thresholds(min_mfu, max_memory_fraction)
    override = load_engine(engine) if engine else None  # a bad --engine is not the job file's fault
    with_gpu_memory(load_cluster("dgx-h100"), gpu_memory)  # a bad --gpu-memory neither
    reading = read_job(job_file, override)  # every problem of the file at once
    if reading.problems:
        render.print_invalid(job_file, reading.problems, fmt, json_out, UNCHECKED)
        raise typer.Exit(EXIT_BAD_INPUT)
    job = reading.job.model_copy(update={"cluster": with_gpu_memory(reading.job.cluster, gpu_memory)})
    layout_line = reading.line_of("layout") if job.layout is not None else None
    try:  # a prediction that is not finite, or a search over budget, fails the gate with its reason
        report = check_job(job.cluster, job.model, job.training, job.layout, **thresholds, engine=job.engine,
                           strict=strict, conservative=conservative)
    except Plan3dError as err:
        render.print_invalid(job_file, [JobProblem("", line, layout_line) for line in err.lines()], fmt, json_out)
        raise typer.Exit(err.exit_code) from err
    notes = [job.engine.zero_note(job.layout), job.engine.split_note(job.layout, job.model)] \
        if job.layout is not None else []
    for note in filter(None, notes):  # checked as the engine runs it (zero_read_as, default_split)
        report.findings.insert(0, Finding("notice", note))
    places = [reading.finding_place(f.message) for f in report.findings]
    if json_out:
        print(json_text(render.check_dict(job_file, job, report, places)))
    else:
        render.print_check(job_file, job, report, fmt, places)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
