"""Error bands: how far a predicted step time may be off, from the benchmark's left-out errors.

A prediction is of an engine running a layout on a GPU. Its *region* is eight features
(`Region`): the engine, the GPU generation, the sharding (ZeRO-3 / FSDP or not), context
parallelism (cp > 1), a mixture-of-experts model, FP8, a zero-bubble pipeline schedule
(one whose deferred weight gradients fill the bubble: ZB-H1, ZB-V, DualPipe(V)), and activation
offloading to host memory. `benchmarks/published.py --write-bands`
predicts every published run of its data with values that never saw the run's source (the
calibration set by leave-one-source-out, the held-out MoE / FP8 / context-parallel rows with the
bundled values, which are never fitted on them) and writes each run's prediction error
e = predicted / measured - 1 with its region to `bundled/validation/error_bands.yaml`.

The band of a prediction is the central `QUANTILES` (10th to 90th percentile) of the errors of
the runs in its region, stretched to hold the prediction and widened by the sources' own rerun
noise (`NOISE`). A region with fewer
than `MIN_RUNS` runs borrows the errors of the nearest region that has them: each feature it
lets go of (`AXES`: a row of data each, with its stated prior and the evidence for it) widens the
band by that feature's prior, and the prediction is *extrapolated* on that feature. A prediction
with no feature let go of is *validated*. The band is asymmetric: the measured step lies in
[predicted / (1 + e_high), predicted / (1 + e_low)].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError

from plan3d.errors import SpecError
from plan3d.specs import schedule as schedules
from plan3d.specs.base import SpecModel, Text
from plan3d.specs.loader import read_mapping, validation_problems

BAND_FILE = Path(__file__).resolve().parent.parent / "bundled" / "validation" / "error_bands.yaml"
QUANTILES = (0.10, 0.90)  # the central 80% of left-out errors
PERCENTILES = "10th-90th"  # QUANTILES, as the bands' sentences name them
MIN_RUNS = 5  # runs a region needs before its own errors set its band
NOISE = 0.03  # the sources' rerun noise (2-4%, shared/data/published/README.md), added to every band
SCALE_FACTOR = 2.0  # a prediction for more than this many times the GPUs of the largest run is extrapolated


# ---- the measured errors (written by benchmarks/published.py --write-bands) ----------------------
class MeasuredRun(SpecModel):
    """One published run predicted by values that never saw its source, and its region."""

    id: Text
    source: Text
    engine: Text
    gpu: Text  # generation
    sharding: Literal["zero3", "zero0-2"]
    cp: bool
    moe: bool
    fp8: bool
    zero_bubble: bool = False
    offload: bool = False
    gpus: int = Field(ge=1)
    error_pct: float = Field(ge=-100, le=10_000)  # predicted / measured - 1, in per cent
    how: Literal["left-out", "held-out"]  # leave-one-source-out, or a held-out row never fitted


class BandData(SpecModel):
    generated_by: Text
    commit: Text = ""
    runs: tuple[MeasuredRun, ...]


@lru_cache(maxsize=4)
def load_band_data(path: Path = BAND_FILE) -> BandData:
    """The bundled measured errors (an empty set where the file is missing: every band a prior)."""
    if not path.is_file():
        return BandData(generated_by="none", runs=())
    try:
        return BandData.model_validate(read_mapping(path))  # lax: the file's lists become tuples
    except ValidationError as err:
        raise SpecError(str(path), validation_problems(err)) from err


# ---- regions ---------------------------------------------------------------------------------
def sharded_stages(engine) -> tuple[int, ...]:
    """The ZeRO stages an engine (an EngineSpec, or None) runs fully sharded: `runs_as.sharded_zero`."""
    return tuple(engine.runs_as.sharded_zero) if engine is not None else (3,)


def is_sharded(zero, sharded_zero: tuple[int, ...]):
    """Whether ZeRO stage `zero` (a number or an array) is in the ZeRO-3/FSDP region."""
    return (np.asarray(zero) >= 3) | np.isin(np.asarray(zero), sharded_zero)


@dataclass(frozen=True)
class Region:
    """What a prediction's accuracy depends on (a published run's, or a layout's)."""

    engine: str  # engine profile name ("" : the cluster's values alone)
    gpu: str  # GPU generation (GPUSpec.generation_name)
    sharding: str  # "zero3" (ZeRO-3 / FSDP: weights gathered per micro-batch) or "zero0-2"
    cp: bool  # context parallelism
    moe: bool  # mixture-of-experts model
    fp8: bool  # FP8 linear layers
    zero_bubble: bool = False  # a schedule filling its bubble with deferred weight gradients
    offload: bool = False  # activations offloaded to host memory (RunsAs.act_offload)

    @classmethod
    def of(cls, engine: str, gpu: str, zero: int, cp: int, moe: bool, precision: str,
           sharded_zero: tuple[int, ...] = (3,), schedule: str = "1f1b", offload: bool = False) -> Region:
        """`sharded_zero`: the stages the engine runs fully sharded (`sharded_stages`); `schedule`:
        the pipeline schedule's name (`is_zero_bubble`); `offload`: activations go to host memory."""
        sharding = "zero3" if bool(is_sharded(zero, sharded_zero)) else "zero0-2"
        return cls(engine, gpu, sharding, cp > 1, moe, precision == "fp8", is_zero_bubble(schedule), offload)

    @property
    def name(self) -> str:
        """'megatron-core on hopper, ZeRO 0-2, dense, 16-bit'."""
        parts = [f"{self.engine or 'no engine'} on {self.gpu}", "ZeRO-3/FSDP" if self.sharding == "zero3" else "ZeRO 0-2",
                 *(["context parallel"] if self.cp else []), "MoE" if self.moe else "dense",
                 "fp8" if self.fp8 else "16-bit", *(["zero-bubble schedule"] if self.zero_bubble else []),
                 *(["activation offload"] if self.offload else [])]
        return ", ".join(parts)


def is_zero_bubble(schedule: str) -> bool:
    """Whether the named schedule fills its bubble with deferred weight gradients (`schedule.zero_bubble`)."""
    return bool(schedules.zero_bubble(schedules.code_of(schedule)))


@dataclass(frozen=True)
class Axis:
    """A region feature a band may let go of: its stated prior widening (prediction error, low and
    high, in per cent) and the evidence that sized it (docs/cost-model.md, "Error bands")."""

    name: str  # a Region field, or "scale"
    prior_pct: tuple[float, float]
    missing: str  # what is extrapolated, with {value}: the region's value of the feature
    evidence: str


AXES = (
    Axis("fp8", (-25.0, 10.0), "fewer than {min_runs} fp8 runs of {engine}",
         "the FP8 GEMM efficiency is a stated prior; the two measured FP8/BF16 pairs (Liu et al. 2025) gained "
         "1.26x and 1.30x where plan3d predicted 1.45x"),
    Axis("cp", (-30.0, 30.0), "fewer than {min_runs} context-parallel runs of {engine}",
         "the K/V exchange's overlap with attention is the engine's; the first context-parallel rows measured "
         "(Liu et al. 2025, 16K-128K) came out -2% to -18%, or +7% to +30% under the causal FLOP reading"),
    Axis("moe", (-30.0, 40.0), "fewer than {min_runs} mixture-of-experts runs of {engine}",
         "dispatch, load balance and grouped GEMMs are the engine's; Liu et al.'s MoE rows came out -13% to +71%"),
    Axis("sharding", (-45.0, 15.0), "fewer than {min_runs} ZeRO-3/FSDP runs of {engine}",
         "whether ZeRO-3's per-micro-batch gathers hide behind compute is the engine's (prefetch depth, the SMs "
         "NCCL takes, the unhidden first gather and last reduce-scatter); DeepSpeed's ZeRO-3 rows came out "
         "31-79% too fast before its collectives were modelled as that engine runs them"),
    Axis("zero_bubble", (-15.0, 5.0), "fewer than {min_runs} zero-bubble or DualPipe runs of {engine}",
         "its fill and drain is the schedule's formula at B = W = F (deferred weight gradients fill the bubble "
         "exactly), while a run also pays the split backward's extra kernels and the optimizer step's "
         "synchronisation; the data's one such run (DeepSeek-V3, DualPipe) is of a framework without a profile"),
    Axis("offload", (-15.0, 10.0), "fewer than {min_runs} runs of {engine} offloading activations",
         "the copies to host memory are priced at the GPU's host link (0.8 of its rate) hidden behind the layer "
         "they leave, without the HBM traffic they take from it; the data's one offloading run (Qwen3-235B on "
         "GB200, MXFP8, Megatron-Core's model zoo) is the only measurement"),
    Axis("gpu", (-10.0, 10.0), "fewer than {min_runs} runs of {engine} on {gpu}",
         "the generation's values come from other engines' runs or its datasheet; the V100 rows, predicted "
         "from datasheet values with an engine fitted on A100, came out -10% to +8%"),
    Axis("engine", (-20.0, 15.0), "fewer than {min_runs} measured runs of {engine}: other engines' errors",
         "its software values are pooled from the engines that have runs; the only Megatron-Core source, "
         "left out of the fit that way, came out -27% to +8%"),
)
SCALE = Axis("scale", (-10.0, 5.0), "more than {factor:g}x the GPUs of the largest run measured ({largest:,})",
             "more ranks per collective and more network tiers than any measured run of the region")
AXIS_BY_NAME = {a.name: a for a in AXES + (SCALE,)}
REGION_FIELDS = tuple(f.name for f in fields(Region))


@dataclass(frozen=True)
class Band:
    """A prediction's error band: e = predicted / measured - 1 lies in [low, high] for the central
    80% of left-out runs like it; `relaxed`: the features it is extrapolated on."""

    region: Region
    low: float
    high: float
    runs: int  # measured runs behind it
    sources: tuple[str, ...]
    relaxed: tuple[str, ...] = ()
    extrapolated: tuple[str, ...] = ()  # one sentence per relaxed feature
    pool: str = ""  # the region whose runs' errors set it: its own, or the nearest one it borrows from
    spread: tuple[float, float] = (0.0, 0.0)  # those runs' errors (e) at QUANTILES, before any widening

    @property
    def validated(self) -> bool:
        return not self.relaxed

    @property
    def tier(self) -> int:
        """How many features the band is extrapolated on (0: validated)."""
        return len(self.relaxed)

    def step_band(self, step_s: float) -> tuple[float, float]:
        """[fast end, slow end] of the measured step time a prediction of `step_s` stands for."""
        return step_s / (1 + self.high), step_s / (1 + self.low)

    def band_pct(self) -> tuple[float, float]:
        """The band as per cent of the prediction: (fast end, slow end), e.g. (-7.0, +23.0)."""
        return 100 * (1 / (1 + self.high) - 1), 100 * (1 / (1 + self.low) - 1)

    def makeup(self) -> str:
        """What the band is made of, in the convention it is computed in (e = predicted / measured
        - 1; the factors 1 + e multiply): 'prediction error -29%/+17%: 14 left-out runs of
        megatron-core on hopper, ... (sources) at -19%/+4% (10th-90th percentile), compounded with
        the rerun noise -3%/+3% and the stated prior -10%/+10% (fewer than 5 runs of megatron-core
        on ampere)'."""
        total = f"prediction error (predicted / measured - 1) {_pct_pair(self.low, self.high)}"
        priors = [f"the prior of what is extrapolated: {'; '.join(self.extrapolated)}"] if self.extrapolated else []
        if not self.runs:
            return f"{total}: no measured run, only " + (priors[0] if priors else "no prior")
        lo, hi = self.spread
        held = "" if lo <= 0 <= hi else ", stretched to hold 0"
        runs = (f"{self.runs} left-out runs of {self.pool} ({', '.join(self.sources)}) at {_pct_pair(lo, hi)} "
                f"({PERCENTILES} percentile{held})")
        return f"{total}: {runs}, compounded with " + " and ".join([f"the rerun noise {_pct_pair(-NOISE, NOISE)}"] + priors)

    def summary(self) -> dict:
        """Plain data for JSON (plan.json, --json)."""
        return {"name": self.region.name, "validated": self.validated, "runs": self.runs,
                "sources": list(self.sources), "error_pct": [100 * self.low, 100 * self.high],
                "extrapolated": list(self.extrapolated), "pool": self.pool, "parts": self.parts(),
                "made_of": self.makeup()}

    def parts(self) -> list[dict]:
        """What compounds to `error_pct` (the factors 1 + e multiply): the runs' spread, the rerun
        noise (both absent without runs) and the stated prior of each feature let go of."""
        measured = [{"part": "runs", "error_pct": [100 * self.spread[0], 100 * self.spread[1]]},
                    {"part": "noise", "error_pct": [-100 * NOISE, 100 * NOISE]}] if self.runs else []
        return measured + [{"part": n, "error_pct": list(AXIS_BY_NAME[n].prior_pct)} for n in self.relaxed]


def _pct_pair(low: float, high: float) -> str:
    """'-19%/+4%' from errors (e)."""
    return f"{100 * low:+.0f}%/{100 * high:+.0f}%"


# A feature the region has (ZeRO-3, cp, MoE, fp8) is let go of by borrowing the errors of the
# region without it; the engine and the GPU generation, by borrowing those of any engine / GPU.
BASE = {"sharding": "zero0-2", "cp": False, "moe": False, "fp8": False, "zero_bubble": False, "offload": False}


def _matches(run: MeasuredRun, region: Region, free: frozenset[str]) -> bool:
    for k in REGION_FIELDS:
        if k not in free:
            if getattr(run, k) != getattr(region, k):
                return False
        elif k in BASE and getattr(run, k) != BASE[k]:
            return False
    return True


def _relaxations(region: Region) -> list[frozenset[str]]:
    """Every set of features the region may let go of (a feature it has, the engine, the GPU):
    the engine last (a prediction is of an engine: another engine's errors are the last resort),
    then fewest first, then the narrowest total prior."""
    names = [a.name for a in AXES if a.name not in BASE or getattr(region, a.name) != BASE[a.name]]
    width = lambda s: sum(AXIS_BY_NAME[n].prior_pct[1] - AXIS_BY_NAME[n].prior_pct[0] for n in s)  # noqa: E731
    sets = [frozenset(c) for k in range(len(names) + 1) for c in combinations(names, k)]
    return sorted(sets, key=lambda s: ("engine" in s, len(s), width(s)))


def band_of(region: Region, gpus: int, data: BandData | None = None) -> Band:
    """The error band of a prediction in `region` for `gpus` GPUs (module docstring)."""
    data = load_band_data() if data is None else data
    return _band_of(region, gpus, data.runs)


@lru_cache(maxsize=4096)
def _band_of(region: Region, gpus: int, runs: tuple[MeasuredRun, ...]) -> Band:
    relaxations = _relaxations(region)
    free, pool = next(((s, p) for s in relaxations if len(p := [r for r in runs if _matches(r, region, s)]) >= MIN_RUNS),
                      (relaxations[-1], []))
    relaxed = [a.name for a in AXES if a.name in free]
    largest = max((r.gpus for r in pool), default=0)
    if pool and gpus > SCALE_FACTOR * largest:
        relaxed.append("scale")
    errors = [r.error_pct / 100 for r in pool]
    low, high = _quantile_band(errors)
    for name in relaxed:
        lo, hi = AXIS_BY_NAME[name].prior_pct
        low, high = low + math.log1p(lo / 100), high + math.log1p(hi / 100)
    sentences = tuple(_sentence(AXIS_BY_NAME[n], region, largest) for n in relaxed)
    spread = tuple(math.expm1(q) for q in _log_quantiles(errors))
    return Band(region, math.expm1(low), math.expm1(high), len(pool), tuple(sorted({r.source for r in pool})),
                tuple(relaxed), sentences, _pool_name(region, free, pool), spread)


def _pool_name(region: Region, free: frozenset[str], pool: list[MeasuredRun]) -> str:
    """The region whose runs a band's errors are: `region` less the features it let go of (an
    engine or a GPU generation let go of: those of the runs, 'megatron-core on hopper')."""
    let_go = {k: BASE[k] for k in free if k in BASE}
    let_go.update({k: "/".join(sorted({getattr(r, k) for r in pool})) for k in ("engine", "gpu") if k in free and pool})
    return replace(region, **let_go).name


def _log_quantiles(errors: list[float]) -> tuple[float, float]:
    """log(1 + e) at the QUANTILES of `errors` (0, 0 for no errors)."""
    if not errors:
        return 0.0, 0.0
    lo, hi = np.quantile(np.log1p(np.asarray(errors, dtype=float)), QUANTILES)
    return float(lo), float(hi)


def _quantile_band(errors: list[float]) -> tuple[float, float]:
    """log(1 + e) at the QUANTILES of `errors`, stretched to hold the prediction itself (0) and
    widened by the NOISE of a measurement: a new run has its own 2-4% on top of the model's
    spread (0, 0 for no errors)."""
    if not errors:
        return 0.0, 0.0
    lo, hi = _log_quantiles(errors)
    return min(lo, 0.0) + math.log1p(-NOISE), max(hi, 0.0) + math.log1p(NOISE)


def _sentence(axis: Axis, region: Region, largest: int) -> str:
    what = axis.missing.format(engine=region.engine or "the cluster's own values", gpu=region.gpu,
                               factor=SCALE_FACTOR, largest=largest, min_runs=MIN_RUNS)
    lo, hi = axis.prior_pct
    return f"{what} (stated prior {lo:+.0f}%/{hi:+.0f}%)"


def without_source(data: BandData, source: str) -> BandData:
    """The measured errors less one source's (what a band would be had that source never been measured)."""
    return data.model_copy(update={"runs": tuple(r for r in data.runs if r.source != source)})


# ---- many predictions at once (the search) ----------------------------------------------------
@dataclass(frozen=True)
class BandArrays:
    """Per evaluated layout: its band's index into `bands`, and the band's error limits."""

    bands: list[Band]
    index: np.ndarray
    low: np.ndarray = field(repr=False)
    high: np.ndarray = field(repr=False)

    @property
    def tier(self) -> np.ndarray:
        return np.array([b.tier for b in self.bands], dtype=np.int64)[self.index]


def band_arrays(engine: str, gpu: str, zero: np.ndarray, cp: np.ndarray, moe: bool, precision: str,
                gpus: int, data: BandData | None = None, sharded_zero: tuple[int, ...] = (3,),
                schedule: np.ndarray | None = None, offload: bool = False) -> BandArrays:
    """The bands of many layouts of one search (a few distinct regions: sharded or not, cp or not,
    a zero-bubble schedule or not; `schedule`: schedule codes, None: 1F1B / interleaved)."""
    zb = (np.zeros(np.shape(zero), dtype=bool) if schedule is None
          else schedules.zero_bubble(schedule))
    keys = np.stack([is_sharded(zero, sharded_zero), np.asarray(cp) > 1, zb], axis=1).astype(np.int8)
    distinct, index = np.unique(keys, axis=0, return_inverse=True)
    bands = [band_of(Region.of(engine, gpu, 3 if z else 0, 2 if c else 1, moe, precision,
                               schedule="zb1p" if b else "1f1b", offload=offload), gpus, data)
             for z, c, b in distinct]
    low = np.array([b.low for b in bands])[index.reshape(-1)]
    high = np.array([b.high for b in bands])[index.reshape(-1)]
    return BandArrays(bands, index.reshape(-1), low, high)


