"""Shared pydantic base: strict models whose unknown keys are errors (style.md, habit 3).

Files are validated strictly (`plan3d.specs.loader.validate`): no bool -> int, str -> int or
str -> float coercion. Physical bounds of the float fields (below) keep a schema-valid 1e308 or
1e-300 from overflowing the cost model; docs/specs.md states them.
"""
from __future__ import annotations

import typing

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    """A spec model: unknown keys are rejected, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class FrozenModel(_NoBoolForIntLiterals):
    """An immutable value object (Layout, resolved tiers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
