"""Cluster spec: nodes, GPUs per node, the GPU, and the network as nested tiers.

Bandwidth units (the trap of cost-model.md: one tool reads "400 GB/s" per node, another per GPU):
a tier states its bandwidth in exactly one of the vendor forms below and the spec converts once,
to bytes/s per GPU in one direction (`ResolvedTier.bandwidth_bytes_per_s`).

| field                    | meaning                                                      |
|--------------------------|--------------------------------------------------------------|
| gbytes_per_s_per_gpu     | GB/s (1e9 bytes) per GPU                                     |
| gbytes_per_s_per_node    | GB/s for the whole node, shared by its GPUs                  |
| gbit_per_s_per_nic       | Gbit/s (1e9 bits) per NIC, with `nics_per_node`              |
| bidirectional            | true when the figure adds both directions (NVLink datasheets)|
"""
from __future__ import annotations

from typing import Callable, Literal

from pydantic import (ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from plan3d.errors import Plan3dError, SpecError
from plan3d.specs.base import (EFFICIENCY, GBIT_PER_S, GBYTES_PER_S, LATENCY_US, FrozenModel, Name, SpecModel,
                               Text, bounded)
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.loader import validation_problems
from plan3d.vocab import COLLECTIVE_KINDS


MAX_NODES = 1_000_000  # bounds keep a typo such as 1e30 from reaching the search (and hanging it)
MAX_GPUS_PER_NODE = 4096
MAX_OVERSUBSCRIPTION = 1e4
MAX_CPU_CORES = 1_000_000
# The validation-context key of the function that turns a GPU name into a GPUSpec
# (plan3d.specs.catalog passes its load_gpu); without it, `gpu:` must be a mapping.
GPU_BY_NAME = "gpu_by_name"
GpuByName = Callable[[str], GPUSpec]


class Bandwidth(SpecModel):
    gbytes_per_s_per_gpu: float | None = bounded(None, GBYTES_PER_S)
    gbytes_per_s_per_node: float | None = bounded(None, GBYTES_PER_S)
    gbit_per_s_per_nic: float | None = bounded(None, GBIT_PER_S)
    nics_per_node: PositiveInt | None = Field(None, le=MAX_GPUS_PER_NODE)
    bidirectional: bool = False

    @model_validator(mode="after")
    def _exactly_one_form(self) -> "Bandwidth":
        forms = [self.gbytes_per_s_per_gpu, self.gbytes_per_s_per_node, self.gbit_per_s_per_nic]
        if sum(f is not None for f in forms) != 1:
            raise ValueError(
                "give exactly one of gbytes_per_s_per_gpu, gbytes_per_s_per_node, "
                "gbit_per_s_per_nic (with nics_per_node)"
            )
        if (self.gbit_per_s_per_nic is None) != (self.nics_per_node is None):
            raise ValueError("gbit_per_s_per_nic and nics_per_node go together")
        return self

    def bytes_per_s_per_gpu(self, gpus_per_node: int) -> float:
        """Per-GPU, one-direction bandwidth in bytes/s."""
        if self.gbytes_per_s_per_gpu is not None:
            value = self.gbytes_per_s_per_gpu * 1e9
        elif self.gbytes_per_s_per_node is not None:
            value = self.gbytes_per_s_per_node * 1e9 / gpus_per_node
        else:
            value = self.gbit_per_s_per_nic * 1e9 / 8 * self.nics_per_node / gpus_per_node
        return value / 2 if self.bidirectional else value


CollectiveOp = Literal[COLLECTIVE_KINDS]  # the `collectives:` keys of a tier (plan3d.vocab)


class CollectiveCost(SpecModel):
    """The alpha-beta pair of one kind of collective on a tier, where it differs from the
    tier's own `latency_us` / `efficiency` (e.g. gloo's reduce-scatter costs an all-reduce;
    a CPU's point-to-point exchange inside a step costs more than back to back)."""

    latency_us: float = bounded(..., LATENCY_US)
    efficiency: float = bounded(..., EFFICIENCY)


class NetworkTier(SpecModel):
    """One level of the network. Tiers are listed inner to outer.

    `domain_gpus` is how many consecutive GPUs one domain of this tier connects (the first tier
    defaults to the node; GB200 NVL72 sets 72); the outermost tier leaves it empty (the cluster).
    """

    name: Name
    domain_gpus: PositiveInt | None = Field(None, le=MAX_NODES * MAX_GPUS_PER_NODE)
    bandwidth: Bandwidth
    latency_us: float = bounded(..., LATENCY_US)
    efficiency: float = bounded(0.8, EFFICIENCY, description="Achievable fraction of bandwidth.")
    oversubscription: float = Field(1.0, ge=1, le=MAX_OVERSUBSCRIPTION,
                                    description="Divides this tier's bandwidth (e.g. 2 for 2:1).")
    collectives: dict[CollectiveOp, CollectiveCost] = Field(
        default_factory=dict, description="Per-collective latency and efficiency overriding the tier's "
        "(written by plan3d calibrate); keys all_reduce, all_gather, reduce_scatter, p2p.")

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bandwidth_has_a_unit(cls, value):
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            raise ValueError(f"{value!r} has no unit; write e.g. {{gbytes_per_s_per_gpu: {value}}} or "
                             f"{{gbit_per_s_per_nic: {value}, nics_per_node: 8}} (see docs/specs.md)")
        return value


class ResolvedTier(FrozenModel):
    """A tier in SI units with its domain size filled in."""

    name: Name
    domain_gpus: int
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    collectives: tuple[tuple[str, float, float], ...] = ()  # (op, latency_s, efficiency)

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def cost(self, op: str) -> tuple[float, float]:
        """(effective bytes/s per GPU, latency s per hop) of collective `op` on this tier."""
        for name, latency_s, efficiency in self.collectives:
            if name == op:
                return self.bandwidth_bytes_per_s * efficiency, latency_s
        return self.effective_bytes_per_s, self.latency_s


def _gpu_by_name_too(schema: dict) -> None:
    """The schema of `gpu` also admits a bundled GPU name, as the loader does."""
    by_spec = schema["properties"]["gpu"]
    schema["properties"]["gpu"] = {"anyOf": [by_spec, {"type": "string", "description": "A bundled GPU name."}]}


class ClusterSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=_gpu_by_name_too)

    name: Name
    description: Text = ""
    nodes: PositiveInt = Field(le=MAX_NODES)
    gpus_per_node: PositiveInt = Field(le=MAX_GPUS_PER_NODE)
    cpu_cores_per_node: PositiveInt | None = Field(
        None, le=MAX_CPU_CORES, description="CPU 'GPUs' only: the cores a node's ranks share. With fewer cores than ranks, "
        "a rank idle in the pipeline bubble hands its core to busy ones (plan3d calibrate writes it).")
    gpu: GPUSpec
    network: list[NetworkTier] = Field(min_length=1)
    source: Text = ""

    @field_validator("gpu", mode="before")
    @classmethod
    def _resolve_gpu_name(cls, value, info: ValidationInfo):
        """`gpu: h100-sxm` names a GPU; the loader passes the look-up in (a spec reads no files)."""
        if not isinstance(value, str):
            return value
        gpu_by_name: GpuByName | None = (info.context or {}).get(GPU_BY_NAME)
        if gpu_by_name is None:
            raise ValueError(f"the GPU {value!r} is a name, which only a spec file may give (plan3d.specs.catalog "
                             "resolves it); give the GPU spec itself")
        try:
            return gpu_by_name(value).model_dump()
        except Plan3dError as err:  # reported with the other fields' problems
            raise ValueError(str(err)) from None

    @model_validator(mode="after")
    def _tiers_nest(self) -> "ClusterSpec":
        """Each tier's domain is a whole number of the domains inside it (the first tier's empty
        domain is the node, the outermost's the cluster)."""
        sizes = [t.domain_gpus for t in self.network[:-1]]
        if any(s is None for s in sizes[1:]):
            raise ValueError("only the first and the outermost tier may leave domain_gpus empty")
        previous, inside = 1, "a GPU"
        for i, tier in enumerate(self.network):
            size = tier.domain_gpus or (self.gpus_per_node if i == 0 and len(self.network) > 1 else None)
            if size is None:
                continue
            if size % previous:
                raise ValueError(f"network.{i}.domain_gpus: tier {tier.name!r} connects {size} GPUs, which is not a "
                                 f"multiple of the {previous} GPUs of {inside}; make it a multiple of {previous}")
            previous, inside = size, f"tier {tier.name!r}" if tier.domain_gpus else "a node (the first tier's default)"
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_size(self, nodes: int | None = None, gpus_per_node: int | None = None) -> "ClusterSpec":
        """The same node type and fabric with another node count or node width; a size past the
        bounds (or a fabric it breaks) is a SpecError naming the cluster, never a pydantic error."""
        data = self.model_dump()
        if nodes is not None:
            data["nodes"] = nodes
        if gpus_per_node is not None:
            data["gpus_per_node"] = gpus_per_node
        try:
            return ClusterSpec.model_validate(data)
        except ValidationError as err:
            raise SpecError(f"cluster {self.name!r} resized to {data['nodes']} x {data['gpus_per_node']} GPUs",
                            validation_problems(err)) from err

    def tiers(self) -> list[ResolvedTier]:
        """Tiers inner to outer in SI units; the outermost spans the whole cluster."""
        resolved = []
        for i, tier in enumerate(self.network):
            last = i == len(self.network) - 1
            domain = tier.domain_gpus or (self.gpus_per_node if i == 0 and not last else self.world_size)
            if last:
                domain = max(domain, self.world_size)
            resolved.append(
                ResolvedTier(
                    name=tier.name,
                    domain_gpus=domain,
                    bandwidth_bytes_per_s=tier.bandwidth.bytes_per_s_per_gpu(self.gpus_per_node) / tier.oversubscription,
                    latency_s=tier.latency_us * 1e-6,
                    efficiency=tier.efficiency,
                    collectives=tuple((op, c.latency_us * 1e-6, c.efficiency)
                                      for op, c in sorted(tier.collectives.items())),
                )
            )
        return resolved
