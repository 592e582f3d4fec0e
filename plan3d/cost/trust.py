"""How far to trust a number: which fitted values an estimate used, and from what data.

An estimate is only as good as the values behind it. The GPU spec carries the hardware values
(the GEMM efficiency curve) and says what they were fitted on (`compute_efficiency.fitted_on`);
the engine profile carries its software values (`efficiency.fitted_on`) and the GPUs of the runs
they were fitted on (`efficiency.calibrated_gpus`). A prediction is inside the validated region
when some calibration run had this engine on this GPU; outside it (an engine never measured on
this GPU, a datasheet-only GPU, an engine profile without measured runs, FP8 with its prior GEMM
efficiency) it is flagged, so
that a user reads it as a first guess.
"""
from __future__ import annotations

from dataclasses import dataclass

from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.engine import EngineSpec
from plan3d.specs.training import TrainingSpec


@dataclass(frozen=True)
class Trust:
    lines: list[str]  # one per source of values
    warnings: list[str]  # predictions outside the validated region


def provenance(cluster: ClusterSpec, engine: EngineSpec | None, training: TrainingSpec, zero: int = 0) -> Trust:
    """The fitted values an estimate of `engine` on `cluster` uses, and what is not validated."""
    gpu = cluster.gpu
    gpu_fit = gpu.compute_efficiency.fitted_on
    lines = [f"{gpu.name}: GEMM efficiency " + (f"fitted on {gpu_fit}" if gpu_fit else "datasheet defaults, not calibrated")]
    warnings = []
    engine_on_gpu = False
    if engine is not None:
        fit = engine.efficiency.fitted_on
        lines.append(f"{engine.name}: software values " + (f"fitted on {fit}" if fit else "not fitted (estimates)"))
        engine_on_gpu = bool(fit) and gpu.name in engine.efficiency.calibrated_gpus
        if not fit and engine.software_values():
            warnings.append(f"engine {engine.name} has no fitted values: its overheads are estimates")
        elif fit and not engine_on_gpu and engine.efficiency.calibrated_gpus:
            warnings.append(f"no calibration run of {engine.name} on {gpu.name} (its values were fitted on "
                            f"{', '.join(engine.efficiency.calibrated_gpus)}): outside the validated region")
    stages = engine.efficiency.calibrated_zero if engine is not None else []
    if stages and zero not in stages:
        warnings.append(f"no calibration run of {engine.name} with ZeRO-{zero} (fitted on ZeRO "
                        f"{', '.join(map(str, stages))}): outside the validated region")
    if not gpu_fit and not engine_on_gpu:
        warnings.append(f"{gpu.name} has no fitted efficiency values (datasheet only): treat times as a first guess")
    if training.precision == "fp8":
        fitted = gpu.generation == "hopper" and "fp8_gemm_fraction" in gpu.compute_efficiency.model_fields_set
        warnings.append(f"fp8: the linear-layer GEMMs run at the fp8 peak with "
                        f"{gpu.compute_efficiency.fp8_gemm_fraction:g} x the bf16 GEMM efficiency, plus the FP8 "
                        "casts; " + ("fitted on five published FP8/BF16 speed-ups on H100 (docs/cost-model.md, FP8)"
                                     if fitted else "a prior, no measured fp8 run on this GPU generation fitted it "
                                     "(docs/cost-model.md, FP8)"))
    return Trust(lines, warnings)
