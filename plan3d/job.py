"""Job file: cluster + model + training (+ an optional layout), the input of `check` and `launch`.

A job composes the specs with a Layout and an engine, so it sits above plan3d.specs and
plan3d.layout (which import nothing of it).

    cluster: dgx-a100-80g        # bundled name, path (relative to this file) or inline mapping
    nodes: 64                    # optional overrides of the cluster size
    model: gpt3-175b
    training: {global_batch: 1536, precision: bf16}
    layout: {tp: 8, pp: 8, dp: 8, micro_batch: 1}
    engine: megatron-core        # optional: bundled name, path or inline mapping; default by cluster

`read_job` reads every part it can and reports every problem at once (`plan3d check`, issue 30),
each with its dotted field and the line of its key: a part that names another (the engine's
default needs the cluster and the model) is resolved only once those are valid; nothing else
depends on another part, so one typo never hides the next.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pydantic import Field, PositiveInt, create_model

from plan3d.errors import Plan3dError, SpecError
from plan3d.layout import Layout
from plan3d.specs.base import SpecModel
from plan3d.specs.catalog import engine_for, load_cluster, load_engine, load_model, lookups, resize
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import RUN_CHOICES, ActOffload, CpComm, EngineSpec, EpDispatcher, EpOverlap
from plan3d.specs.loader import check_model, read_mapping_with_lines
from plan3d.specs.model import ModelSpec
from plan3d.specs.training import TrainingSpec


class JobSpec(SpecModel):
    cluster: str | ClusterSpec
    nodes: PositiveInt | None = None
    gpus_per_node: PositiveInt | None = None
    model: str | ModelSpec
    training: TrainingSpec
    layout: Layout | None = None
    engine: str | EngineSpec | None = None
    cp_comm: CpComm | None = Field(None, description="Context parallelism's K/V exchange (as --cp-comm); "
                                   "default: what the engine runs.")
    ep_dispatcher: EpDispatcher | None = Field(None, description="The MoE token dispatcher (as --ep-dispatcher); "
                                               "default: what the engine runs.")
    ep_overlap: EpOverlap | None = Field(None, description="How the MoE all-to-alls hide (as --ep-overlap); "
                                         "default: what the engine runs.")
    act_offload: ActOffload | None = Field(None, description="The activations offloaded to host memory (as "
                                           "--act-offload); default: what the engine runs.")


class Job(SpecModel):
    """A job with every name resolved (the engine: the job's, or the cluster's default)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    layout: Layout | None = None
    engine: EngineSpec


SECTIONS = {"cluster": ClusterSpec, "model": ModelSpec, "training": TrainingSpec, "layout": Layout,
            "engine": EngineSpec}  # the parts of a job that are a spec of their own when written out
NAMED = {"cluster": load_cluster, "model": load_model, "engine": load_engine}  # ... or name a spec


@dataclass(frozen=True)
class JobProblem:
    """One thing wrong with a job file: the dotted field it is at ('training.global_batch'; '' for
    the file as a whole), what to change, and the 1-based line of that field's key (for a missing
    field its parent's, 1 at the top; None where the text gave no lines)."""

    field: str
    message: str
    line: int | None = None

    def text(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def located(self, source: str) -> str:
        """'job.yaml:17: training.global_bach: unknown field ...', as compilers write it."""
        return f"{source}{f':{self.line}' if self.line else ''}: {self.text()}"


@dataclass
class JobReading:
    """A job file read as far as it goes: the job (None while any problem is left) and every problem."""

    job: Job | None
    problems: list[JobProblem]
    lines: dict[str, int] = field(default_factory=dict)  # dotted key path -> line (plan3d.specs.loader.key_lines)

    def line_of(self, dotted: str) -> int | None:
        return line_of(self.lines, dotted)

    def finding_place(self, message: str) -> tuple[str, int | None]:
        """(field, line) a check finding points at: the layout field its sentence starts with
        ('tp=5 does not divide ...': layout.tp), else `layout` ('' without a layout in the job)."""
        if self.job is None or self.job.layout is None:
            return "", None
        first = re.match(r"[a-z_]+", message)
        dotted = f"layout.{first.group()}" if first and f"layout.{first.group()}" in self.lines else "layout"
        return dotted, self.line_of(dotted)


class InvalidJob(SpecError):
    """A job file with problems: one line per problem, with its line in the file."""

    def __init__(self, source: str, problems: list[JobProblem]):
        self.job_problems = problems
        super().__init__(source, [p.text() for p in problems])

    def lines(self) -> list[str]:
        return [p.located(self.source) for p in self.job_problems]


def load_job(path_str: str, engine: EngineSpec | None = None) -> Job:
    """The job file with names resolved; `engine` (e.g. `check --engine`) overrides the file's `engine:`.
    Every problem of the file is one InvalidJob."""
    reading = read_job(path_str, engine)
    if reading.problems:
        raise InvalidJob(path_str, reading.problems)
    return reading.job


def read_job(path_str: str, engine: EngineSpec | None = None) -> JobReading:
    """Every part of the job file that can be read, and every problem found (none: `job` is set)."""
    path = Path(path_str)
    try:
        data, lines = read_mapping_with_lines(path)
    except Plan3dError as err:
        return JobReading(None, [_file_problem(path_str, err)])
    parts = _Parts(path_str, lines)
    job = parts.job(data, engine)
    problems = sorted(_renames_merged(parts.problems), key=lambda p: (p.line is None, p.line or 0))  # file order
    return JobReading(None if problems else job, problems, lines)


def line_of(lines: dict[str, int], dotted: str) -> int | None:
    """The line of `dotted`'s key, else of its nearest written parent, else 1 (None: no lines known)."""
    if not lines:
        return None
    parts = dotted.split(".") if dotted else []
    while parts:
        if ".".join(parts) in lines:
            return lines[".".join(parts)]
        parts.pop()
    return 1


def _renames_merged(problems: list[JobProblem]) -> list[JobProblem]:
    """A misspelt required key is one problem, not two: 'training.global_bach: unknown field; did you
    mean 'global_batch'?' absorbs 'training.global_batch: missing'."""
    missing = {p.field for p in problems if p.message.startswith("missing; add")}
    out, absorbed = [], set()
    for p in problems:
        meant = _meant(p)
        if meant in missing:
            absorbed.add(meant)
            p = JobProblem(p.field, p.message + " (it is required)", p.line)
        out.append(p)
    return [p for p in out if p.field not in absorbed or not p.message.startswith("missing; add")]


def _meant(problem: JobProblem) -> str | None:
    """The field an unknown key's 'did you mean' names, as a dotted path."""
    found = re.search(r"did you mean '([^']+)'\?$", problem.message)
    if not found:
        return None
    parent = problem.field.rpartition(".")[0]
    return f"{parent}.{found.group(1)}" if parent else found.group(1)


def _file_problem(path_str: str, err: Plan3dError) -> JobProblem:
    """The file could not be read or parsed: one problem, at the line the parser names."""
    message = "; ".join(err.problems) if isinstance(err, SpecError) and err.source == path_str else str(err)
    message = message.removeprefix(f"{path_str}: ")
    found = re.search(r"\bat line (\d+)", message)
    return JobProblem("", message, int(found.group(1)) if found else None)


class _Parts:
    """Reads a job's parts one by one, collecting the problems of each (`read_job`)."""

    def __init__(self, source: str, lines: dict[str, int]):
        self.source, self.lines, self.base = source, lines, Path(source).parent
        self.problems: list[JobProblem] = []

    def add(self, dotted: str, message: str) -> None:
        self.problems.append(JobProblem(dotted, _what_to_change(dotted, message), line_of(self.lines, dotted)))

    def attempt(self, dotted: str, call, *args):
        """`call(*args)`, or None with its error's lines as problems at `dotted`."""
        try:
            return call(*args)
        except Plan3dError as err:
            for line in err.lines():
                self.add(dotted, line.removeprefix(f"{self.source}: "))
            return None

    def job(self, data: dict, engine: EngineSpec | None) -> Job | None:
        self.top_level(data)
        nodes, gpus = (self.plain(name, data) for name in ("nodes", "gpus_per_node"))
        choices = {name: self.plain(name, data) for name in RUN_CHOICES}  # cp_comm, ep_dispatcher, ep_overlap, act_offload
        training, layout = self.part("training", data), self.part("layout", data)
        cluster, model = self.cluster(data, nodes, gpus), self.part("model", data)
        engine = engine or self.engine(data, cluster, model)
        for name, value in choices.items():
            if engine is not None and value is not None:
                engine = self.attempt(name, lambda v, e=engine, n=name: e.with_choice(n, v), value)
        if self.problems:
            return None
        return Job(cluster=cluster, model=model, training=training, layout=layout, engine=engine)

    def top_level(self, data: dict) -> None:
        fields = list(JobSpec.model_fields)
        for key in data:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(fields)}"
                self.add(key, "unknown field (misspelled?)" + hint)
        for name, info in JobSpec.model_fields.items():
            if info.is_required() and name not in data:
                self.add(name, "Field required")

    def plain(self, name: str, data: dict):
        """A field that is no spec (nodes, gpus_per_node, the RUN_CHOICES), validated as JobSpec does."""
        if data.get(name) is None:
            return None
        checked, problems = check_model(_field_model(name), {name: data[name]})
        for dotted, message in problems:
            self.add(dotted, message)
        return getattr(checked, name, None)

    def part(self, name: str, data: dict):
        """A spec part: an inline mapping validated on its own, a name (or path) looked up."""
        value = data.get(name)
        if isinstance(value, dict):
            checked, problems = check_model(SECTIONS[name], value, lookups(), prefix=name)
            for dotted, message in problems:
                self.add(dotted, message)
            return checked
        if isinstance(value, str) and name in NAMED:
            return self.attempt(name, NAMED[name], _relative(self.base, value))
        if value is not None or name in data and JobSpec.model_fields[name].is_required():
            what = "a bundled name, a file path or a mapping of fields" if name in NAMED else "a mapping of fields"
            self.add(name, f"give {what}, got {_short(value)}")
        return None

    def engine(self, data: dict, cluster: ClusterSpec | None, model: ModelSpec | None) -> EngineSpec | None:
        """The file's engine, or the default for the cluster and model (once both are valid)."""
        if data.get("engine") is not None:
            return self.part("engine", data)
        if cluster is None or model is None:
            return None
        return self.attempt("engine", engine_for, None, cluster, model)

    def cluster(self, data: dict, nodes: int | None, gpus: int | None) -> ClusterSpec | None:
        cluster = self.part("cluster", data)
        if cluster is None or (nodes is None and gpus is None):
            return cluster
        source = data["cluster"] if isinstance(data["cluster"], str) else self.source
        return self.attempt("nodes" if nodes is not None else "gpus_per_node", resize, cluster, nodes, gpus, source)


@lru_cache(maxsize=None)
def _field_model(name: str) -> type[SpecModel]:
    """A model of JobSpec's one field `name`, to validate that field apart from the others."""
    info = JobSpec.model_fields[name]
    return create_model(f"JobSpec_{name}", __base__=SpecModel, **{name: (info.annotation, info)})


def _what_to_change(dotted: str, message: str) -> str:
    """pydantic's 'Field required' as what to add, and where."""
    if message != "Field required":
        return message
    parent, _, leaf = dotted.rpartition(".")
    return f"missing; add `{leaf}:`" + (f" under `{parent}:`" if parent else "")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _relative(base: Path, name_or_path: str) -> str:
    """Paths in a job file are relative to the job file; bare names stay bundled names."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml", ".json")):
        candidate = base / name_or_path
        return str(candidate if not Path(name_or_path).is_absolute() else name_or_path)
    return name_or_path
