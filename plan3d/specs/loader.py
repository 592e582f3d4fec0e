"""Reading spec files: YAML or JSON, safe loading only, pydantic errors turned into one line per field."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from plan3d.errors import SpecError, SpecNotFound

M = TypeVar("M", bound=BaseModel)


class _SpecLoader(yaml.SafeLoader):
    """Safe YAML, except that `2e9` and `1.5e-3` are numbers (YAML 1.2), not strings (PyYAML's YAML 1.1)."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_mapping(path: Path) -> dict:
    """Parse a YAML or JSON file into a mapping, or raise a one-line SpecError."""
    if not path.exists():
        raise SpecNotFound(f"{path}: no such file; give a path to a spec file or a bundled name (plan3d specs list)")
    if path.is_dir():
        raise SpecError(str(path), ["is a directory, not a spec file"])
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(str(path), [f"cannot be read ({err.__class__.__name__}: {err})"]) from err
    return parse_mapping(text, str(path), json_only=path.suffix == ".json")


def parse_mapping(text: str, source: str, json_only: bool = False) -> dict:
    if not text.strip():
        raise SpecError(source, ["is empty; a spec is a YAML or JSON mapping of fields"])
    try:
        data = json.loads(text) if json_only else yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(source, [f"not valid {'JSON' if json_only else 'YAML'}{line}: {reason}"]) from err
    if data is None:
        raise SpecError(source, ["holds no fields (only comments?); a spec is a YAML or JSON mapping of fields"])
    if not isinstance(data, dict):
        raise SpecError(source, [f"must be a mapping of fields, got {type(data).__name__}"])
    return data


def validation_problems(err: ValidationError, prefix: str = "") -> list[str]:
    """One readable line per bad field: 'network.0.latency_us: Input should be ...'."""
    lines = []
    for item in err.errors():
        path = ".".join(str(p) for p in (prefix, *item["loc"]) if p != "" and not _internal_loc(p))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "int_parsing_size":
            message = f"{item['input']!r} is far too large for this field"
        if item["type"] == "extra_forbidden":
            message = "unknown field (misspelled?)" + _closest_hint(item, err)
        lines.append(f"{path}: {message}" if path else message)  # model-level checks name their fields
    return lines


def _internal_loc(part) -> bool:
    """pydantic's names for validator wrappers ('function-after[_check(), ClusterSpec]'), not fields."""
    return isinstance(part, str) and part.startswith("function-") and part.endswith("]")


def _closest_hint(item: dict, err: ValidationError) -> str:
    import difflib

    model = getattr(err, "_plan3d_model", None)
    if model is None:
        return ""
    name = str(item["loc"][-1])
    fields = _fields_at(model, item["loc"][:-1])
    close = difflib.get_close_matches(name, fields, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid fields: {', '.join(fields)}" if fields else ""


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the nested model at `loc` (best effort, for 'did you mean')."""
    import typing

    current = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _model_in(field.annotation, typing)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation, typing) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg, typing)
        if found is not None:
            return found
    return None


def validate(model: type[M], data: dict, source: str) -> M:
    """Validate `data` as `model`; raise SpecError with one line per bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        err._plan3d_model = model  # for 'did you mean'
        raise SpecError(source, validation_problems(err)) from err
    except (SpecNotFound, SpecError) as err:  # raised by nested catalog look-ups
        raise SpecError(source, err.lines()) from err
