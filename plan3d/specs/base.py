"""Shared pydantic base: strict models whose unknown keys are errors (style.md, habit 3).

Files are validated strictly (`plan3d.specs.loader.validate`): no bool -> int, str -> int or
str -> float coercion. Physical bounds of the float fields (below) keep a schema-valid 1e308 or
1e-300 from overflowing the cost model; docs/specs.md states them.
"""
from __future__ import annotations

import typing

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Generous but physical ranges, in the units of the field names (docs/specs.md, "Bounds").
MEMORY_GIB = dict(ge=1e-3, le=1e6)  # 1 MiB .. ~1 PiB per device
TFLOPS = dict(ge=1e-6, le=1e6)  # 1 MFLOP/s .. 1 EFLOP/s per device and dtype
TBYTES_PER_S = dict(ge=1e-6, le=1e4)  # device-memory bandwidth
GBYTES_PER_S = dict(ge=1e-6, le=1e6)  # network bandwidth, 1 kB/s .. 1 PB/s
GBIT_PER_S = dict(ge=1e-6, le=1e7)
LATENCY_US = dict(ge=0, le=1e9)  # at most 1000 s per message
FRACTION = dict(ge=0, le=1)
EFFICIENCY = dict(ge=1e-4, le=1)  # a share of a peak: (0, 1], at least 1e-4
OVERHEAD_S = dict(ge=0, le=1e3)
BYTES_PER_ELEMENT = dict(ge=0, le=1e6)
FLOPS = dict(ge=0, le=1e18)
COUNT = dict(ge=1, le=1_000_000)


NAME_MAX_CHARS = 200
TEXT_MAX_CHARS = 2000


def _one_line_problem(value: str, max_chars: int) -> str | None:
    """Why `value` is not one line of printable text (a control character, a line or paragraph
    separator, a zero-width format character, a non-ASCII space), or None."""
    if len(value) > max_chars:
        return f"is {len(value):,} characters long; at most {max_chars:,}"
    bad = next((i for i, ch in enumerate(value) if not ch.isprintable()), None)
    if bad is not None:
        return (f"holds the control character {ascii(value[bad])} at position {bad}; "
                "write one line of printable text")
    return None


def _check_name(value: str) -> str:
    """A spec name: one line of printable text that starts with a letter or digit (so it can
    neither begin an output line of its own, e.g. a GitHub `::error::` workflow command, nor
    hide in whitespace). Unicode letters are welcome: 'Llama 3.1 (8B)', 'modèle-7b'."""
    problem = _one_line_problem(value, NAME_MAX_CHARS)
    if problem is None and not (value[:1].isalnum() and not value[-1:].isspace()):
        problem = "must start with a letter or digit and not end with a space"
    if problem:
        raise ValueError(f"the name {_quoted(value)} {problem}, e.g. 'llama3-8b'")
    return value


def _check_text(value: str) -> str:
    """Free text of a spec (description, source, fitted_on): one line of printable text."""
    problem = _one_line_problem(value, TEXT_MAX_CHARS)
    if problem:
        raise ValueError(f"the text {_quoted(value)} {problem}")
    return value


def printable(text: str) -> str:
    """`text` on one line: newlines and other control characters written as escapes (\\n, \\x1b),
    so a name from a spec file cannot start a line of its own (a GitHub workflow command such as
    `::error::`, which the runner reads from any line of a step's output)."""
    return "".join(ch if ch.isprintable() or ch == "\t" else ascii(ch)[1:-1] for ch in text)


def _quoted(value: str) -> str:
    """`value` quoted for an error message, escaped and cut short."""
    text = ascii(value) if not value.isprintable() else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The one rule for every spec's `name` (model, GPU, cluster, network tier, engine) and for the
# free text a spec carries; docs/specs.md, "Names and text".
Name = typing.Annotated[str, AfterValidator(_check_name)]
Text = typing.Annotated[str, AfterValidator(_check_text)]


def bounded(default=..., bounds: dict | None = None, **kwargs):
    """A Field with one of the physical ranges above."""
    return Field(default, **(bounds or {}), **kwargs)


class _NoBoolForIntLiterals(BaseModel):
    """`zero: true` is not stage 1: pydantic's Literal[0, 1, 2, 3] would take True == 1."""

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_int_literals(cls, data):
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is not None and _bool_would_pass_as_int(field.annotation, value):
                raise ValueError(f"{name}: {value!r} holds a boolean (true/false) where a number goes; give a number")
        return data


def _bool_would_pass_as_int(annotation, value) -> bool:
    if isinstance(value, list):
        return any(_bool_would_pass_as_int(_item_type(annotation), v) for v in value)
    return isinstance(value, bool) and any(type(a) is int for a in _literal_values(annotation))


def _item_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 or typing.get_origin(annotation) in (list, tuple) else None


def _literal_values(annotation) -> tuple:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return tuple(v for a in typing.get_args(annotation) for v in _literal_values(a))


class StrictModel(_NoBoolForIntLiterals):
    """A strict model: unknown keys are rejected, values are validated on assignment (a record
    filled in steps, such as the Plan)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class SpecModel(StrictModel):
    """A spec: strict, and immutable once validated. Specs are shared (the catalog caches its
    look-ups, a Plan holds the objects it was built from), so a change is a new object:
    `spec.model_copy(update=...)`."""

    model_config = ConfigDict(frozen=True)


class FrozenModel(_NoBoolForIntLiterals):
    """An immutable value object (Layout, resolved tiers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
