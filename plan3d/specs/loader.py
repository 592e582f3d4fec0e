"""Reading spec files: YAML or JSON, safe loading only, pydantic errors turned into one line per field.

The one validation boundary of every file a command reads (specs, jobs, plans, run directories):

- YAML is read as YAML 1.2 reads it (the JSON-compatible core schema), not as PyYAML's YAML 1.1:
  `1:30` is a string (not 90), `yes`/`on` are strings (not booleans), `2e9` is a number; an
  integer with a leading zero (`040`, octal 32 in YAML 1.1, 40 in YAML 1.2) is refused as
  ambiguous; timestamps stay strings; a key given twice in one mapping is an error.
- JSON: a key given twice, `NaN` and `Infinity` are errors.
- Only a regular file is read (a FIFO, /dev/zero or a terminal would never end), and only up to
  MAX_SPEC_BYTES (specs, jobs) or MAX_RUN_FILE_BYTES (plans and run-directory files, which list
  every rank), checked before reading.
- Whatever the syntax, the data must be JSON data (mappings with string keys, lists, strings,
  finite numbers, booleans, null), at most MAX_DEPTH levels deep and MAX_VALUES values in all.
- Models are validated strictly (`validate`): no bool -> int, str -> int or float -> int coercion.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
import difflib
import typing
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from plan3d.errors import SpecError, SpecNotFound, special_file_kind

M = TypeVar("M", bound=BaseModel)
# pydantic's strict type errors, whose message gains the value given ('got True', 'got "2"')
STRICT_TYPE_ERRORS = ("int_type", "float_type", "bool_type", "string_type", "literal_error", "list_type",
                      "dict_type", "model_type", "tuple_type")
MAX_DEPTH = 32  # specs nest 5 levels, a plan 6; a bound that keeps a hostile file from recursing
MAX_VALUES = 20_000_000  # keeps YAML aliases from expanding to billions of values (a plan of 131072 ranks holds ~3M)
JSON_TYPES = (dict, list, str, int, float, bool, type(None))
MAX_SPEC_BYTES = 16 * 2**20  # a spec or job file is a few kB; docs/specs.md, "Strict reading"
MAX_RUN_FILE_BYTES = 256 * 2**20  # a plan of 131072 ranks is ~32 MiB, a run's metrics ~300 bytes a step


class _SpecLoader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2's core schema for plain scalars, and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key; SafeConstructor reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice in one mapping (YAML keeps only the last)", key_node.start_mark)
        seen.add(key)


def _construct_int(loader: yaml.SafeLoader, node) -> int:
    """YAML 1.2 integers: decimal, 0o octal, 0x hexadecimal (no YAML 1.1 0-octal, 1:30 or 1_000)."""
    text = loader.construct_scalar(node)
    return int(text, 0) if text.lstrip("+-")[:2] in ("0o", "0x") else int(text)


def _refuse_leading_zero(loader: yaml.SafeLoader, node) -> None:
    text = loader.construct_scalar(node)
    octal = f"octal {int(text, 8)}" if set(text) <= set("+-01234567") else "an error"
    raise yaml.constructor.ConstructorError(
        None, None, f"{text} has a leading zero (YAML 1.1 reads it as {octal}, YAML 1.2 as {int(text)}); "
        f"write {int(text)} without the zero", node.start_mark)


_LEADING_ZERO = "tag:plan3d,2024:leading-zero-int"
_MERGE = "tag:yaml.org,2002:merge"
_SpecLoader.yaml_implicit_resolvers = {}  # YAML 1.2 core schema only (drops 1.1's yes/no, 1:30, dates, 010)
for _tag, _pattern, _first in (
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    (_LEADING_ZERO, r"^[-+]?0[0-9]+$", list("-+0")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"]),
):
    _SpecLoader.add_implicit_resolver(_tag, re.compile(_pattern), _first)
_SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_SpecLoader.add_constructor(_LEADING_ZERO, _refuse_leading_zero)


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    data = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} is given twice in one object (JSON readers keep only the last)")
        data[key] = value
    return data


def _json_constant(name: str):
    raise ValueError(f"{name} is not a number plan3d accepts (give a finite number)")


def loads_json(text: str):
    """Strict JSON: duplicate keys, NaN and Infinity refused (ValueError)."""
    return json.loads(text, object_pairs_hook=_json_object, parse_constant=_json_constant)


def read_mapping(path: Path, max_bytes: int = MAX_SPEC_BYTES) -> dict:
    """Parse a YAML or JSON file into a mapping, or raise a one-line SpecError."""
    if not path.exists():
        raise SpecNotFound(f"{path}: no such file; give a path to a spec file or a bundled name (plan3d specs list)")
    return parse_mapping(read_text(path, max_bytes), str(path), json_only=path.suffix == ".json")


def read_mapping_with_lines(path: Path, max_bytes: int = MAX_SPEC_BYTES) -> tuple[dict, dict[str, int]]:
    """`read_mapping`, and where each key is written: `key_lines` of the same text."""
    if not path.exists():
        raise SpecNotFound(f"{path}: no such file; give a path to a spec file or a bundled name (plan3d specs list)")
    text = read_text(path, max_bytes)
    return parse_mapping(text, str(path), json_only=path.suffix == ".json"), key_lines(text)


def key_lines(text: str) -> dict[str, int]:
    """The 1-based line of every key of a YAML (or JSON, a subset) text by its dotted path, as
    `validation_items` names fields: {'training': 4, 'training.global_batch': 5, 'network.0': 9}
    (a list item: the line it starts on). The text is composed once with the reading loader and
    its node tree walked, each node once (an alias is not followed again); a key merged in with
    `<<` is at the line of that `<<`. {} for a text that does not compose."""
    try:
        root = yaml.compose(text, Loader=_SpecLoader)  # noqa: S506 (a SafeLoader; composing builds no objects)
    except (yaml.YAMLError, RecursionError, ValueError):
        return {}
    found: dict[str, int] = {}
    _walk_lines(root, (), found, set())
    return found


def _walk_lines(node, path: tuple, found: dict[str, int], seen: set) -> None:
    if id(node) in seen or len(path) > MAX_DEPTH:
        return
    seen.add(id(node))
    for key, (key_node, value) in _node_children(node, {}).items():
        child_path = (*path, key)
        found.setdefault(_dotted(child_path), key_node.start_mark.line + 1)
        _walk_lines(value, child_path, found, seen)


def _node_children(node, memo: dict) -> dict:
    """{key: (the node whose line is the key's, value node)} of a mapping (its own keys first, then
    the merged ones, each merged mapping read once) or a list (an item's line is its own)."""
    if isinstance(node, yaml.SequenceNode):
        return {i: (item, item) for i, item in enumerate(node.value)}
    if not isinstance(node, yaml.MappingNode):
        return {}
    if id(node) not in memo:
        memo[id(node)] = {}  # a merge that reaches its own mapping again adds nothing
        children = {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE}
        for merge_key, merged in ((k, v) for k, v in node.value if k.tag == _MERGE):
            for part in merged.value if isinstance(merged, yaml.SequenceNode) else [merged]:
                items = _node_children(part, memo).items() if isinstance(part, yaml.MappingNode) else ()
                for key, (_, value) in items:
                    children.setdefault(key, (merge_key, value))
        memo[id(node)] = children
    return memo[id(node)]


def read_text(path: Path, max_bytes: int = MAX_SPEC_BYTES, errors: str = "strict") -> str:
    """The text of `path` (UTF-8, universal newlines) if it is a regular file of at most
    `max_bytes`; anything else (a directory, a FIFO, a device such as /dev/zero, a socket, a
    larger file) is a one-line SpecError, raised before a byte is read (so nothing blocks)."""
    try:
        _check_regular(path, os.stat(path), max_bytes)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in meanwhile: no wait
        with os.fdopen(fd, "rb") as file:
            _check_regular(path, os.fstat(file.fileno()), max_bytes)
            data = file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise SpecError(str(path), [_too_large(max_bytes)])
        text = data.decode("utf-8", errors=errors)
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(str(path), [f"cannot be read ({err.__class__.__name__}: {err})"]) from err
    return text.replace("\r\n", "\n").replace("\r", "\n")


def check_file(path: Path, max_bytes: int = MAX_SPEC_BYTES) -> None:
    """Raise read_text's one-line SpecError if `path` (which exists) is no regular file of at most
    `max_bytes`, for a reader elsewhere (the runtime's own jsonl readers), without reading it."""
    try:
        _check_regular(path, os.stat(path), max_bytes)
    except OSError as err:
        raise SpecError(str(path), [f"cannot be read ({err.__class__.__name__}: {err})"]) from err


def _check_regular(path: Path, info: os.stat_result, max_bytes: int) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise SpecError(str(path), ["is a directory, not a spec file"])
    if not stat.S_ISREG(info.st_mode):
        kind = special_file_kind(info.st_mode)
        raise SpecError(str(path), [f"is {kind}, not a regular file; give the path of a file"])
    if info.st_size > max_bytes:
        raise SpecError(str(path), [_too_large(max_bytes, info.st_size)])


def _too_large(max_bytes: int, size: int | None = None) -> str:
    held = f" ({size:,} bytes)" if size is not None else ""
    return f"is larger than {max_bytes // 2**20} MiB{held}, the most plan3d reads of such a file; is it the right file?"


def parse_mapping(text: str, source: str, json_only: bool = False) -> dict:
    """The mapping a YAML (or, with `json_only`, JSON) text holds, checked to be plain JSON data."""
    if not text.strip():
        raise SpecError(source, ["is empty; a spec is a YAML or JSON mapping of fields"])
    data = _parse(text, source, json_only)
    if data is None:
        raise SpecError(source, ["holds no fields (only comments?); a spec is a YAML or JSON mapping of fields"])
    if not isinstance(data, dict):
        raise SpecError(source, [f"must be a mapping of fields, got {type(data).__name__}"])
    problem = json_data_problem(data)
    if problem:
        raise SpecError(source, [problem])
    return data


def _parse(text: str, source: str, json_only: bool):
    kind = "JSON" if json_only else "YAML"
    try:
        return loads_json(text) if json_only else yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(source, [f"not valid {kind}{line}: {reason}"]) from err
    except json.JSONDecodeError as err:
        raise SpecError(source, [f"not valid JSON at line {err.lineno}: {err.msg}"]) from err
    except ValueError as err:  # a duplicate key, NaN, or an integer too long to read
        raise SpecError(source, [f"not valid {kind}: {' '.join(str(err).split())}"]) from err
    except RecursionError as err:
        raise SpecError(source, [f"nested too deeply to be a spec (at most {MAX_DEPTH} levels)"]) from err


def json_data_problem(data) -> str | None:
    """The first reason `data` is not plain, finite, bounded JSON data ('field.path: why'), or None.
    A container reached twice (a YAML alias) is measured once, so an alias bomb costs no time."""
    try:
        size, _ = _measure(data, (), {})
    except _NotJsonData as bad:
        return str(bad)
    return None


class _NotJsonData(ValueError):
    pass


def _measure(value, path: tuple, memo: dict) -> tuple[int, int]:
    """(values, levels) of `value` as it would expand; raise _NotJsonData at the first problem."""
    if not isinstance(value, (dict, list)):
        problem = _scalar_problem(value)
        if problem:
            raise _NotJsonData(f"{_dotted(path)}: {problem}" if path else problem)
        return 1, 0
    if id(value) not in memo:
        if len(path) >= MAX_DEPTH:
            raise _NotJsonData(f"{_dotted(path)}: nested deeper than {MAX_DEPTH} levels")
        memo[id(value)] = _measure_children(value, path, memo)
    size, levels = memo[id(value)]
    if len(path) + levels > MAX_DEPTH:
        raise _NotJsonData(f"{_dotted(path) or 'the file'}: nested deeper than {MAX_DEPTH} levels")
    return size, levels


def _measure_children(value: dict | list, path: tuple, memo: dict) -> tuple[int, int]:
    if isinstance(value, dict):
        bad_key = next((k for k in value if not isinstance(k, str)), None)
        if bad_key is not None:
            raise _NotJsonData(f"{_dotted(path) or 'top level'}: key {_short(bad_key)} is not a string; quote it")
    items = value.items() if isinstance(value, dict) else enumerate(value)
    size, levels = 1, 0
    for key, child in items:
        child_size, child_levels = _measure(child, (*path, key), memo)
        size, levels = size + child_size, max(levels, child_levels + 1)
        if size > MAX_VALUES:
            raise _NotJsonData(f"{_dotted(path) or 'the file'}: holds more than {MAX_VALUES:,} values "
                               "(YAML aliases expanding?)")
    return size, levels


def _scalar_problem(value) -> str | None:
    if not isinstance(value, JSON_TYPES):
        return f"a {type(value).__name__} value ({_short(value)}) is not JSON data; write a string or a number"
    if isinstance(value, float) and not math.isfinite(value):
        return f"Input should be a finite number, got {value} (inf and nan are rejected)"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole_floats_as_ints(value):
    """`2e1` -> 20 (JSON has one number type); floats past 2**53 stay floats ('far too large')."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    return value


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def validation_problems(err: ValidationError, prefix: str = "") -> list[str]:
    """One readable line per bad field: 'network.0.latency_us: Input should be ...'."""
    return [f"{path}: {message}" if path else message  # model-level checks name their fields
            for path, message in validation_items(err, prefix)]


def validation_items(err: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted field path, readable message) per bad field: ('network.0.latency_us', 'Input should be ...');
    the path is '' (or `prefix`) for a model-level check, whose message names its fields."""
    items = []
    for item in err.errors():
        path = ".".join(str(p) for p in (prefix, *item["loc"]) if p != "" and not _internal_loc(p))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "int_parsing_size" or _huge_float_for_an_int(item):
            message = f"{item['input']!r} is far too large for this field"
        if item["type"] == "extra_forbidden":
            message = "unknown field (misspelled?)" + _closest_hint(item, err)
        elif item["type"] in STRICT_TYPE_ERRORS:
            message += f", got {_short(item['input'])}"
        items.append((path, message))
    return items


def _huge_float_for_an_int(item: dict) -> bool:
    value = item.get("input")
    return item["type"] == "int_type" and isinstance(value, float) and value.is_integer()


def _internal_loc(part) -> bool:
    """pydantic's names for validator wrappers ('function-after[_check(), ClusterSpec]'), not fields."""
    return isinstance(part, str) and part.startswith("function-") and part.endswith("]")


def _closest_hint(item: dict, err: ValidationError) -> str:
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
    current = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def validate(model: type[M], data: dict, source: str, context: dict[str, Any] | None = None) -> M:
    """Validate `data` (plain JSON data) as `model`, strictly, as JSON: a bool, a string or a float
    with a fraction is no integer (`2e1` is 20, as in JSON) and a string is no number or bool.
    `context` reaches the validators (pydantic's validation context), e.g. the catalog look-ups
    a spec file may name (`plan3d.specs.catalog.LOOKUPS`). Raise SpecError with one line per bad field."""
    problem = json_data_problem(data)
    if problem:
        raise SpecError(source, [problem])
    try:
        return _validate_json(model, data, context)
    except ValidationError as err:
        raise SpecError(source, validation_problems(err)) from err
    except (SpecNotFound, SpecError) as err:  # raised by nested catalog look-ups
        raise SpecError(source, err.lines()) from err


def check_model(model: type[M], data, context: dict[str, Any] | None = None,
                prefix: str = "") -> tuple[M | None, list[tuple[str, str]]]:
    """`validate` that raises nothing: (the model, []) or (None, its `validation_items`), each
    path under `prefix` (a part of a larger file, e.g. a job's 'training'). For a reader that
    reports every part of a file at once (`plan3d check`)."""
    problem = json_data_problem(data)
    if problem:
        return None, [(prefix, problem)]
    try:
        return _validate_json(model, data, context), []
    except ValidationError as err:
        return None, validation_items(err, prefix)
    except (SpecNotFound, SpecError) as err:  # raised by nested catalog look-ups
        return None, [(prefix, line) for line in err.lines()]


def _validate_json(model: type[M], data, context: dict[str, Any] | None) -> M:
    """Strict JSON validation; a ValidationError remembers `model` (for 'did you mean')."""
    try:
        return model.model_validate_json(json.dumps(_whole_floats_as_ints(data)), strict=True, context=context)
    except ValidationError as err:
        err._plan3d_model = model
        raise
