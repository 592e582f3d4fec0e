"""Output of `plan3d check`: plain text, GitHub workflow annotations, JSON."""
from __future__ import annotations

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


def annotation(path: str, finding: Finding) -> str:
    """`::error file=PATH,title=plan3d check::message (fix: ...)`."""
    body = finding.message + (f". Fix: {finding.fix}" if finding.fix else "")
    return (f"::{GITHUB_LEVELS[finding.level]} file={_escape_property(path)},title=plan3d check::"
            f"{_escape_data(body)}")


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


def print_check(path: str, job, report: CheckReport, fmt: str) -> None:
    lines = [verdict_line(path, job, report), f"  engine: {engine_text(job.engine)}"]
    if fmt == "github":
        lines += [annotation(path, f) for f in report.findings]
    else:
        for f in report.findings:
            lines.append(f"  {f.level}: {f.message}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
    if summary(report):
        lines.append(f"  {summary(report)}")
    print("\n".join(printable(line) for line in lines))


def print_invalid(path: str, problems: list[str], fmt: str, json_out: bool) -> None:
    """An invalid job file (exit 2): the annotations or JSON go to stdout, the CLI adds `error:` lines."""
    findings = [Finding("error", p, "fix the job file; `plan3d specs schema job` shows its schema") for p in problems]
    if json_out:
        print(json_text({"schema_version": SCHEMA_VERSION, "file": path, "valid": False, "ok": False,
                          "findings": [vars(f) for f in findings]}))
    elif fmt == "github":
        print("\n".join(printable(annotation(path, f)) for f in findings))


def check_dict(path: str, job, report: CheckReport) -> dict:
    est = report.estimate
    keep = ("step_time_s", "step_time_s_band", "validated", "region", "tokens_per_s", "model_tflops_per_gpu",
            *UTILISATION, "peak_memory_bytes", "capacity_bytes", "fits", "bubble_fraction")
    return {"schema_version": SCHEMA_VERSION, "file": path, "valid": True, "ok": report.ok,
            "engine": job.engine.name, "cluster": job.cluster.name, "gpus": job.cluster.world_size,
            "model": job.model.name,
            "layout": job.layout.model_dump(mode="json") if job.layout is not None else None,
            "findings": [vars(f) for f in report.findings], "conservative": report.conservative,
            "estimate": {k: est[k] for k in keep if k in est} if est else None,
            "recommended": report.recommended}
