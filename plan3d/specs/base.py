"""Shared pydantic base: strict models whose unknown keys are errors (style.md, habit 3)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A spec model: unknown keys are rejected, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class FrozenModel(BaseModel):
    """An immutable value object (Layout, resolved tiers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
