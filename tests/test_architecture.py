"""The shape of src/ampkit: import layers, no cycles between files, small files and functions.

The layer table follows docs/architecture.md ("Layers").  Imports are read with ``ast``,
function-level imports included and ``if TYPE_CHECKING:`` blocks excluded, so a lazy import
inside a function cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ampkit"

# (module prefix, layer): the longest matching prefix decides.  A module may import its own layer
# (without a cycle) and every layer below it.  `_util` sits below everything; `ampkit` (the lazy
# public face) and the CLI sit at the top.  lint stands apart and is checked by its own rule.
LAYERS: dict[str, int] = {
    "ampkit._util": 0,
    "ampkit.precision": 1, "ampkit.scaler": 1, "ampkit.policy": 1, "ampkit.hooks": 1, "ampkit.findings": 1,
    "ampkit.thresholds": 1, "ampkit._guards": 1, "ampkit._state": 1, "ampkit._boundary": 1, "ampkit.fp8": 1,
    "ampkit.engine": 2, "ampkit.checkpoint": 2, "ampkit.config": 2,
    "ampkit.telemetry": 3, "ampkit.distributed": 3, "ampkit.tasks": 3, "ampkit.env": 3,
    "ampkit.diagnose": 4, "ampkit.verify": 4, "ampkit.integrations": 4, "ampkit.mixed_precision": 4,
    "ampkit.cli": 5,
    "ampkit": 6,
}
LINT = "ampkit.lint"
LINT_MAY_USE = frozenset({"ampkit._util", "ampkit._util.io"})
"""lint is pure AST and starts without torch: outside its package it uses only the atomic writer."""


MAX_FILE_LINES = 450
MAX_DEF_LINES = 60


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def _files() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    files = _files()
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ampkit"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "ampkit":
        return []
    # `from ampkit.x import y` imports the submodule ampkit.x.y when it is one, else ampkit.x
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in _files() else target for a in node.names]


@cache
def _imports_of(module: str) -> frozenset[str]:
    path = _files()[module]
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(child: ast.AST) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in _import_targets(child, module, is_package):
                resolved = _resolve(target)
                if resolved is not None and resolved != module:
                    found.add(resolved)
        visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(found)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _upward_imports() -> set[tuple[str, str]]:
    bad = set()
    for module in _files():
        for target in _imports_of(module):
            if module.startswith(LINT):
                if not (target.startswith(LINT) or target in LINT_MAY_USE):
                    bad.add((module, target))
            elif target.startswith(LINT):
                if not module.startswith("ampkit.cli") and module != "ampkit":
                    bad.add((module, target))
            elif _layer(target) > _layer(module):
                bad.add((module, target))
    return bad


def _cycles() -> set[frozenset[str]]:
    """Strongly connected components of more than one file (a package's own __init__ re-exporting
    its submodules is its public face, not a dependency, so that edge is left out)."""
    graph = {m: {t for t in _imports_of(m) if not t.startswith(m + ".")} for m in _files()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in graph:
        if v not in index:
            strong(v)
    return found


def test_architecture_every_module_has_a_layer() -> None:
    for module in _files():
        assert any(module == p or module.startswith(p + ".") for p in LAYERS), (
            f"{module} has no layer in tests/test_architecture.py LAYERS; add it where docs/architecture.md's Layers section puts it")


def test_architecture_no_upward_imports() -> None:
    bad = _upward_imports()
    assert bad == set(), "imports against the layers: " + ", ".join(f"{a} -> {b}" for a, b in sorted(bad))


def test_architecture_no_import_cycles_between_files() -> None:
    cycles = _cycles()
    assert cycles == set(), "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_architecture_lint_imports_nothing_outside_lint_but_the_torch_free_io() -> None:
    outside = {(m, t) for m, t in _upward_imports() if m.startswith(LINT)}
    assert outside == set(), sorted(outside)


def _long_defs(path: Path) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > MAX_DEF_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    return long


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_architecture_file_and_def_sizes(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(SRC)} has {lines} lines (at most {MAX_FILE_LINES}): split it"
    assert _long_defs(path) == [], f"functions over {MAX_DEF_LINES} lines (docstring included): split them"



def _declared_all(module: str) -> set[str] | None:
    for node in ast.parse(_files()[module].read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return set(ast.literal_eval(node.value))
    return None


def _names_imported_from_modules(module: str) -> list[tuple[str, str]]:
    """(source module, name) for each ``from ampkit.X import name`` in ``module`` (submodules excluded)."""
    path = _files()[module]
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            targets = _import_targets(node, module, is_package)
            for alias, target in zip(node.names, targets):
                if target in _files() and not target.endswith(f".{alias.name}") and target != module:
                    found.append((target, alias.name))
    return found


def _package(module: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if _files()[module].name == "__init__.py" else module.rpartition(".")[0]


def _is_private_module(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def _shares_package(importer: str, source: str) -> bool:
    """Whether ``importer`` may use ``source``'s ``_`` names: both sit in one package (a ``_`` module
    serves its whole package tree: ``ampkit._util`` serves ``ampkit``'s)."""
    home = _package(source)
    if _is_private_module(source):
        home = home.split("._")[0]
    return importer == home or importer.startswith(home + ".")


@pytest.mark.parametrize("module", sorted(_files()))
def test_architecture_modules_import_only_listed_public_names(module: str) -> None:
    for source, name in _names_imported_from_modules(module):
        if name.startswith("__") and name.endswith("__"):
            continue
        if name.startswith("_"):
            assert _shares_package(module, source), (
                f"{module} imports the private {source}.{name} from another package: make it public")
            continue
        listed = _declared_all(source)
        assert listed is not None and name in listed, f"{module} imports {name}, missing from {source}.__all__"


def test_architecture_private_names_are_shared_only_within_their_package() -> None:
    assert _shares_package("ampkit.verify.harness", "ampkit.verify.budget")
    assert _shares_package("ampkit.verify", "ampkit.verify.budget")
    assert _shares_package("ampkit.diagnose.step.replay", "ampkit._util.io")
    assert not _shares_package("ampkit.diagnose.step.replay", "ampkit.verify.budget")
    assert not _shares_package("ampkit.telemetry.core", "ampkit.diagnose.script.models")
    assert _shares_package("ampkit.distributed.launch", "ampkit.distributed._shard")
    assert not _shares_package("ampkit.verify.harness", "ampkit.distributed._shard")


DOCS = [*sorted((SRC.parent / "docs").glob("*.md")), SRC.parent / "README.md"]


@pytest.mark.parametrize("package", sorted(m for m, p in _files().items()
                                           if p.name == "__init__.py" and not _is_private_module(m)))
def test_architecture_public_surface_is_documented(package: str) -> None:
    """What a package's ``__init__`` exports is its public surface, so the docs must name it."""
    try:
        exported = _declared_all(package) or set()
    except ValueError:  # a computed __all__ (the lazy top level re-exports lists of its own)
        pytest.skip(f"{package}.__all__ is computed")
    docs = " ".join(path.read_text(encoding="utf-8") for path in DOCS)
    undocumented = sorted(n for n in exported if not re.search(rf"\b{re.escape(n)}\b", docs))
    assert not undocumented, f"{package} exports {undocumented}, which no page of docs/ names"
