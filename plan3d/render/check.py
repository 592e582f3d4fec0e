"""Output of `plan3d check`: plain text, GitHub workflow annotations (each at the line of its field), JSON."""
from __future__ import annotations

import sys

from plan3d.job import JobProblem
from plan3d.ranking import CheckReport, Finding
from plan3d.render.engine import engine_text
from plan3d.render.recommend import duration
from plan3d.render.units import gib, json_text, printable
from plan3d.vocab import UTILISATION

SCHEMA_VERSION = 1
GITHUB_LEVELS = {"error": "error", "warning": "warning", "notice": "notice"}


def _escape_data(text: str) -> str:
    """GitHub workflow-command escaping of a message."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(path: str, level: str, message: str, field: str = "", line: int | None = None) -> str:
    """`::error file=PATH,line=N,title=plan3d check: FIELD::message` (line= where known)."""
    where = f",line={line}" if line else ""
    title = f"plan3d check: {field}" if field else "plan3d check"
    return (f"::{GITHUB_LEVELS[level]} file={_escape_property(path)}{where},title={_escape_property(title)}::"
            f"{_escape_data(message)}")


Place = tuple[str, int | None]  # (dotted field, line) a finding points at (plan3d.job.JobReading.finding_place)


def finding_annotation(path: str, finding: Finding, place: Place) -> str:
    body = finding.message + (f". Fix: {finding.fix}" if finding.fix else "")
    return annotation(path, finding.level, body, *place)


def summary(report: CheckReport) -> str | None:
    est = report.estimate
    if not est:
        return None
    band = est.get("step_time_s_band") or []
    band_text = (f" (band {duration(band[0])}-{duration(band[1])}, "
                 f"{'validated' if est.get('validated') else 'extrapolated'})" if band else "")
    return (f"predicted: step {duration(est['step_time_s'])}{band_text}, {est['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {est['mfu']:.1%}, peak {gib(est['peak_memory_bytes'])} of {gib(est['capacity_bytes'])} usable")


def verdict_line(path: str, job, report: CheckReport) -> str:
    what = job.layout.short() if job.layout is not None else "no layout"
    status = "PASS" if report.ok else "FAIL"  # a non-finite prediction never gets here: estimate() raises
    return f"{status} {path}: {job.model.name} on {job.cluster.world_size} {job.cluster.gpu.name}, {what}"


def print_check(path: str, job, report: CheckReport, fmt: str, places: list[Place] | None = None) -> None:
    """The verdict: text (a line per finding with its fix), or github (one verdict line, then an
    annotation per finding at its place in the job file, `places[i]` for `report.findings[i]`)."""
    places = places or [("", None)] * len(report.findings)
    if fmt == "github":
        head = f"{verdict_line(path, job, report)}; engine {job.engine.name}"
        lines = [head + (f"; {summary(report)}" if summary(report) else "")]
        lines += [finding_annotation(path, f, place) for f, place in zip(report.findings, places)]
    else:
        lines = [verdict_line(path, job, report), f"  engine: {engine_text(job.engine)}"]
        for f in report.findings:
            lines.append(f"  {f.level}: {f.message}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
        if summary(report):
            lines.append(f"  {summary(report)}")
    print("\n".join(printable(line) for line in lines))


def print_invalid(path: str, problems: list[JobProblem], fmt: str, json_out: bool, unchecked: str = "") -> None:
    """A job that cannot be checked (exit 2): each problem once. Text: an `error:` line per problem
    on stderr; github: an annotation per problem on stdout; --json: the problems as JSON. Then, on
    stderr, at most one summary line; `unchecked` says what was skipped for them."""
    if json_out:
        print(json_text({"schema_version": SCHEMA_VERSION, "file": path, "valid": False, "ok": False,
                         "findings": [problem_dict(p) for p in problems]}))
    elif fmt == "github":
        print("\n".join(printable(annotation(path, "error", p.message, p.field, p.line)) for p in problems))
    lines = [p.located(path) for p in problems] if fmt == "text" and not json_out else []
    if len(problems) > 1 or not lines:
        lines.append(invalid_summary(path, problems, "the JSON" if json_out else fmt, unchecked))
    print("\n".join(printable(f"error: {line}") for line in lines), file=sys.stderr)


def invalid_summary(path: str, problems: list[JobProblem], shown_in: str, unchecked: str = "") -> str:
    """'job.yaml: 3 problems (annotated above); ...'; one problem in JSON: that problem's line."""
    if len(problems) == 1 and shown_in == "the JSON":
        return problems[0].located(path)
    where = {"github": "annotated above", "text": "listed above"}.get(shown_in, f"listed in {shown_in}")
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    return f"{path}: {count} ({where})" + (f"; {unchecked}" if unchecked else "")


def problem_dict(p: JobProblem) -> dict:
    return {"level": "error", "message": p.text(), "fix": "", "field": p.field, "line": p.line}


def finding_dict(f: Finding, place: Place) -> dict:
    return {**vars(f), "field": place[0], "line": place[1]}


def check_dict(path: str, job, report: CheckReport, places: list[Place] | None = None) -> dict:
    places = places or [("", None)] * len(report.findings)
    est = report.estimate
    keep = ("step_time_s", "step_time_s_band", "validated", "region", "tokens_per_s", "model_tflops_per_gpu",
            *UTILISATION, "peak_memory_bytes", "capacity_bytes", "fits", "bubble_fraction",
            "cp_comm", "ep_dispatcher", "ep_overlap", "act_offload", "host_offload_bytes")  # the job's choices
    return {"schema_version": SCHEMA_VERSION, "file": path, "valid": True, "ok": report.ok,
            "engine": job.engine.name, "cluster": job.cluster.name, "gpus": job.cluster.world_size,
            "model": job.model.name,
            "layout": job.layout.model_dump(mode="json") if job.layout is not None else None,
            "findings": [finding_dict(f, place) for f, place in zip(report.findings, places)],
            "conservative": report.conservative,
            "estimate": {k: est[k] for k in keep if k in est} if est else None,
            "recommended": report.recommended}
