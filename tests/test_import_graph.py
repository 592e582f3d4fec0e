"""The direction of imports (issue 13), read from the source with `ast`: nothing here imports plan3d.

- plan3d/specs is the bottom layer with plan3d.errors: pure data and validation, importing no
  other plan3d module and holding no import circle.
- plan3d/runtime records what happened and never predicts: it imports nothing of plan3d.cost.
- torch is imported at module level only inside plan3d/runtime, directly or through another
  module's module-level imports (a command that measures imports it inside a function).
- No module of plan3d imports an engine (DeepSpeed, Megatron, torchtitan): only tests do.

An import counts at module level unless it sits in a function or under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "plan3d"
SPECS = "plan3d.specs"
BELOW_SPECS = ("plan3d.errors", "plan3d.vocab")  # what a spec module may import besides other spec modules (leaves)
ENGINES = ("deepspeed", "megatron", "torchtitan", "transformer_engine")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (for `from m import name`: m.name when that is a module)
    line: int
    module_level: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, root: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import statement of one file, with absolute targets."""
    source = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(source, t, child.lineno, module_level)
                             for t in _targets(child, source, is_package, modules))
            inside = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _type_checking(child)
            visit(child, module_level and not inside)

    visit(tree, True)
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, one level up per extra dot
        package = source.split(".") if is_package else source.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(root: Path = PACKAGE_DIR) -> list[Import]:
    modules = package_modules(root)
    return [imp for path in modules.values() for imp in imports_of(path, root, modules)]


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graphs here are a few dozen modules
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def module_level_closure(start: str, graph: list[Import], modules: set[str]) -> set[str]:
    """The plan3d modules importing `start` runs (its module-level imports, their parent packages, ...)."""
    edges: dict[str, set[str]] = {}
    for imp in graph:
        if imp.module_level and within(imp.target, "plan3d"):
            parts = imp.target.split(".")
            edges.setdefault(imp.source, set()).update(
                ".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges.get(name, ()))
    return seen


GRAPH = import_graph()
SPEC_MODULES = sorted(m for m in package_modules() if within(m, SPECS))


def upward_imports(module: str) -> list[str]:
    return [f"{imp.source}:{imp.line} imports {imp.target}" for imp in GRAPH
            if imp.source == module and within(imp.target, "plan3d") and not within(imp.target, SPECS)
            and not any(within(imp.target, below) for below in BELOW_SPECS)]


@pytest.mark.parametrize("module", SPEC_MODULES)
def test_a_spec_module_imports_only_specs_and_errors(module):
    assert upward_imports(module) == []


def test_specs_hold_no_import_circle():
    edges: dict[str, set[str]] = {}
    for imp in GRAPH:  # function-level imports too: a circle hidden in a function is still a circle
        if within(imp.source, SPECS) and within(imp.target, SPECS):
            edges.setdefault(imp.source, set()).add(imp.target)
    assert circles(edges) == []


def test_specs_import_at_module_level():
    """Nothing in specs/ (or errors.py below it) hides a dependency inside a function."""
    hidden = [f"{imp.source}:{imp.line} {imp.target}" for imp in GRAPH
              if not imp.module_level and (within(imp.source, SPECS) or imp.source == "plan3d.errors")]
    assert hidden == []


def test_the_runtime_never_imports_the_cost_model():
    found = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in GRAPH
             if within(imp.source, "plan3d.runtime") and within(imp.target, "plan3d.cost")]
    assert found == []


def test_only_the_runtime_imports_torch_at_module_level():
    torch_at_import = {imp.source for imp in GRAPH if imp.module_level and within(imp.target, "torch")}
    outside = sorted(m for m in {imp.source for imp in GRAPH} if not within(m, "plan3d.runtime"))
    modules = set(package_modules())
    leaks = {m: sorted(torch_at_import & module_level_closure(m, GRAPH, modules)) for m in outside}
    assert {m: via for m, via in leaks.items() if via} == {}


def test_no_module_imports_an_engine():
    found = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in GRAPH
             if any(within(imp.target, engine) for engine in ENGINES)]
    assert found == []


# The analysis itself, on a package written for the purpose: it must see what the tests above forbid.

def _write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "plan3d"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_analysis_sees_levels_relative_imports_and_circles(tmp_path):
    root = _write_package(tmp_path, {
        "__init__.py": "",
        "specs/__init__.py": "",
        "specs/a.py": "from plan3d.specs import b\nimport torch\n",
        "specs/b.py": "def f():\n    from . import a\n    import torch\n",
        "specs/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                      "from ..plan import Plan\n",
        "plan.py": "from plan3d.specs.a import x\n",
    })
    graph = import_graph(root)
    seen = {(imp.source, imp.target, imp.module_level) for imp in graph}
    assert ("plan3d.specs.a", "plan3d.specs.b", True) in seen
    assert ("plan3d.specs.b", "plan3d.specs.a", False) in seen  # relative, inside a function
    assert ("plan3d.specs.b", "torch", False) in seen
    assert ("plan3d.specs.c", "torch", False) in seen  # under TYPE_CHECKING: never imported
    assert ("plan3d.specs.c", "plan3d.plan", True) in seen
    edges = {}
    for imp in graph:
        edges.setdefault(imp.source, set()).add(imp.target)
    assert circles(edges) == [["plan3d.specs.a", "plan3d.specs.b"]]
    runs = module_level_closure("plan3d.plan", graph, set(package_modules(root)))
    assert runs == {"plan3d", "plan3d.plan", "plan3d.specs", "plan3d.specs.a", "plan3d.specs.b"}  # not c
