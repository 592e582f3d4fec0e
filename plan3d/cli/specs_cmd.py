"""`plan3d specs list|show|schema`."""
from __future__ import annotations

import difflib
from typing import Annotated, Optional

import typer

from plan3d.cli.app import specs_app
from plan3d.errors import SpecError, SpecNotFound
from plan3d.render.specs import catalog_rows, print_catalog, print_spec
from plan3d.render.units import json_text
from plan3d.schema import schemas
from plan3d.specs import catalog


@specs_app.command("list")
def specs_list(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the bundled GPUs, clusters, models and engines."""
    rows = catalog_rows()
    if json_out:
        print(json_text(rows))
    else:
        print_catalog(rows)


@specs_app.command("show")
def specs_show(
    name: str,
    kind: Annotated[Optional[str], typer.Option("--kind", help="cluster, model, gpu or engine")] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show one bundled spec (or a spec file) with its values in SI and human units."""
    spec = _load_any(name, kind)
    if json_out:
        print(spec.model_dump_json(indent=1))
    else:
        print_spec(spec)


def _load_any(name: str, kind: str | None):
    loaders = {"cluster": catalog.load_cluster, "model": catalog.load_model, "gpu": catalog.load_gpu,
               "engine": catalog.load_engine}
    if kind is not None:
        if kind not in loaders:
            raise SpecNotFound(f"--kind {kind!r}: use one of {', '.join(loaders)}")
        return loaders[kind](name)
    invalid = []  # a spec file is tried as each kind: report the kind it is closest to
    for loader in loaders.values():
        try:
            return loader(name)
        except SpecNotFound:
            continue
        except SpecError as err:
            invalid.append(err)
    if invalid:
        raise min(invalid, key=lambda err: len(err.problems))
    kinds = {n: k for k in loaders for n in catalog.bundled_names(k)}
    close = similar_names(name, list(kinds))
    named = [f"{n!r} ({kinds[n]})" for n in close]
    hint = f"did you mean {' or '.join([', '.join(named[:-1]), named[-1]] if len(named) > 1 else named)}? " \
        if close else ""
    raise SpecNotFound(f"no bundled spec named {name!r}: {hint}see `plan3d specs list`")


def similar_names(query: str, names: list[str], limit: int = 3) -> list[str]:
    """Names that start with the query, then names that contain it; difflib's closest only if none do.

    'h100' -> h100-sxm, dgx-h100 (difflib alone says h200: one letter away, but another GPU)."""
    query = query.lower()
    starts = [n for n in names if n.startswith(query)]
    contains = [n for n in names if query in n and n not in starts]
    if starts or contains:
        return (sorted(starts) + sorted(contains))[:limit]
    return difflib.get_close_matches(query, names, n=1, cutoff=0.4)


@specs_app.command("schema")
def specs_schema(
    kind: Annotated[Optional[str], typer.Argument(
        help="cluster, gpu, model, engine, training, layout, job or plan")] = None,
) -> None:
    """Print the JSON Schema of each spec kind (for editors and CI)."""
    all_schemas = schemas()
    if kind is not None and kind not in all_schemas:
        raise SpecNotFound(f"unknown schema {kind!r}; use one of {', '.join(all_schemas)}")
    print(json_text(all_schemas[kind] if kind else all_schemas))
