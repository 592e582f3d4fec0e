"""Tables for `plan3d specs`."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plan3d.cost.params import active_params, total_params
from plan3d.render.units import count, gbytes_per_s
from plan3d.specs import catalog
from plan3d.specs.cluster import ClusterSpec
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.model import ModelSpec


def catalog_rows() -> list[dict]:
    rows = []
    for name in catalog.bundled_names("cluster"):
        c = catalog.load_cluster(name)
        rows.append({"kind": "cluster", "name": name,
                     "summary": f"{c.nodes} x {c.gpus_per_node} {c.gpu.name} = {c.world_size} GPUs; "
                                + ", ".join(f"{t.name} {gbytes_per_s(t.bandwidth_bytes_per_s)}/GPU" for t in c.tiers())})
    for name in catalog.bundled_names("model"):
        m = catalog.load_model(name)
        rows.append({"kind": "model", "name": name,
                     "summary": f"{model_size(m)}, {m.layers} layers, hidden {m.hidden}, "
                                f"{m.heads} heads ({m.kv_heads_} kv), {m.activation}, seq {m.seq_len}"})
    for name in catalog.bundled_names("gpu"):
        g = catalog.load_gpu(name)
        peak = g.peak_tflops.get("bf16") or max(g.peak_tflops.values())
        rows.append({"kind": "gpu", "name": name,
                     "summary": f"{g.memory_gib:g} GiB, {peak:g} TFLOP/s bf16 dense, {g.hbm_tbytes_per_s:g} TB/s"})
    for name in catalog.bundled_names("engine"):
        e = catalog.load_engine(name)
        default = " [default]" if name == catalog.DEFAULT_ENGINE else ""
        rows.append({"kind": "engine", "name": name,
                     "summary": f"{e.description or e.name}{default}" + (f"; {e.version}" if e.version else "")})
    return rows


def model_size(model: ModelSpec) -> str:
    """'8.03B params'; a mixture-of-experts model adds its experts and the parameters one token uses."""
    size = f"{count(total_params(model))} params"
    if model.moe is None:
        return size
    return f"{size} ({count(active_params(model))} active; {model.moe.experts} experts, top {model.moe.top_k})"


def print_catalog(rows: list[dict]) -> None:
    table = Table(title="plan3d bundled specs")
    for column in ("kind", "name", "summary"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["kind"], row["name"], escape(row["summary"]))
    Console().print(table)


def print_spec(spec) -> None:
    table = Table(title=f"{type(spec).__name__} {spec.name}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in spec.model_dump(exclude={"network", "gpu"}).items():
        table.add_row(key, escape(str(value)))
    if isinstance(spec, ModelSpec):
        table.add_row("parameters", f"{total_params(spec):,} ({count(total_params(spec))})")
        if spec.moe is not None:
            table.add_row("active parameters", f"{active_params(spec):,} ({count(active_params(spec))}) per token")
    if isinstance(spec, ClusterSpec):
        table.add_row("gpu", f"{spec.gpu.name}: {spec.gpu.memory_gib:g} GiB")
        for tier in spec.tiers():
            table.add_row(f"tier {tier.name}", f"{gbytes_per_s(tier.bandwidth_bytes_per_s)} per GPU one way, "
                          f"{tier.latency_s * 1e6:g} us, efficiency {tier.efficiency:g}, domain {tier.domain_gpus} GPUs")
    if isinstance(spec, GPUSpec):
        table.add_row("memory", f"{spec.memory_bytes:.4g} bytes")
    Console().print(table)
