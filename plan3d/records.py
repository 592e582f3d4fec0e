"""The typed records of what plan3d predicts and writes: the bounds a plan or a run directory
states, and `Estimate`, the one type of a prediction -- what `plan3d.cost.estimate.estimate`
returns and what a plan file carries (docs/specs.md, "Plan")."""
from __future__ import annotations

import copy
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from plan3d.specs.base import Text

# Physical bounds of what a plan or a run directory states (docs/specs.md, "Plan"): finite, and
# small enough that a ratio, a sum or a unit conversion of them stays finite.
MAX_SECONDS = 1e9  # ~32 years
MAX_BYTES = 1e18  # an exabyte
MAX_RATE = 1e18  # tokens/s, FLOP/s
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Bytes = Annotated[float, Field(ge=0, le=MAX_BYTES, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, le=MAX_RATE, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


class _Record(BaseModel):
    """A section of a plan file as typed fields. Fields the file leaves out stay out when the plan is
    written back (`model_dump`), so a plan round-trips to the JSON it was read from and keeps its digest.

    Read the attributes; `given(key)` says whether the file or the producer gave a field."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_serializer(mode="wrap")
    def _as_given(self, handler):
        given = self.model_fields_set | set(self.model_extra or {})
        return {k: v for k, v in handler(self).items() if k in given}

    def given(self, key: str) -> bool:
        return key in self.model_fields_set or key in (self.model_extra or {})

    @classmethod
    def unchecked(cls, values: dict[str, Any]):
        """The record of `values` as they are (a fresh prediction: plans are checked when loaded)."""
        return cls.model_construct(**values)


class Estimate(_Record):
    """Every term of the prediction for one layout, SI units (bytes, seconds, FLOP/s): what
    `plan3d.cost.estimate.estimate` returns (`fresh`, every field given) and what a plan carries,
    as `report` and `launch` read it: SI values within physical bounds, text on one line. Plans
    written by older versions may lack the optional fields; other keys (a newer plan3d's) pass if
    they are plain JSON data. `memory_bytes` is of the most-loaded rank, `stage_memory_bytes` the
    total per pipeline rank, `tiers` the tier each group spans, `provenance` which fitted values
    were used."""

    step_time_s: Seconds
    tokens_per_s: Rate
    model_tflops_per_gpu: Rate | None = None
    mfu: Ratio | None = None  # plan3d.vocab.UTILISATION: causal model FLOPs (plans before them: non-causal)
    mfu_noncausal: Ratio | None = None
    hfu: Ratio | None = None
    peak_memory_bytes: Bytes
    capacity_bytes: Bytes | None = None
    fits: bool | None = None
    bubble_fraction: Ratio | None = None
    memory_bytes: dict[str, Bytes]  # plan3d.vocab.MEMORY_TERMS of the most-loaded rank
    stage_memory_bytes: list[Bytes] = []
    time_s: dict[str, Seconds]  # plan3d.vocab.TIME_TERMS
    tiers: dict[str, Text] = {}
    worst_pp_rank: Annotated[int, Field(ge=0, le=10**9)] | None = None
    warnings: list[Text] = []
    layout: dict[str, Any] = {}
    engine: Text = ""
    provenance: list[Text] = []
    cp_comm: Text = ""
    ep_dispatcher: Text = ""
    ep_overlap: Text = ""
    act_offload: Text = ""
    host_offload_bytes: Bytes = 0.0
    step_time_s_band: list[Seconds] = []  # plan3d.cost.bands: [fast end, slow end] of the measured step
    validated: bool | None = None
    region: dict[str, Any] = {}
    grad_dtype: Text = ""
    recompute_layers: Annotated[int, Field(ge=0, le=10**6)] = 0  # partial recompute: layers per virtual chunk

    @classmethod
    def fresh(cls, **values) -> "Estimate":
        """A new prediction, every field given (the defaults too), so that it writes whole."""
        defaults = {name: copy.deepcopy(f.default) for name, f in cls.model_fields.items() if name not in values}
        return cls.model_construct(**defaults, **values)

    def with_values(self, **values) -> "Estimate":
        """This estimate with `values` replaced."""
        return self.model_copy(update=values)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data, a copy (the plan file's estimate, `--json`)."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        return copy.deepcopy(out | dict(self.model_extra or {}))


