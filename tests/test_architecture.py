"""The shape of src/ampkit: import layers, small files and functions (no circles: tests/test_import_graph.py).

The layer table follows docs/architecture.md ("Layers").  Imports are read with ``ast``,
function-level imports included and ``if TYPE_CHECKING:`` blocks excluded, so a lazy import
inside a function cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.imports import PACKAGE, SRC, import_targets, imports_of, modules

# (module prefix, layer): the longest matching prefix decides.  A module may import its own layer
# (without a cycle) and every layer below it.  `_util` sits below everything; `ampkit` (the lazy
# public face) and the CLI sit at the top.  lint stands apart and is checked by its own rule.
LAYERS: dict[str, int] = {
    "ampkit._util": 0,
    "ampkit.precision": 1, "ampkit.scaler": 1, "ampkit.policy": 1, "ampkit.hooks": 1, "ampkit.findings": 1,
    "ampkit.thresholds": 1, "ampkit._scaler_rules": 1, "ampkit.fp8": 1, "ampkit.fp8recipes": 1,
    "ampkit.engine": 2, "ampkit.checkpoint": 2,
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


def _files() -> dict[str, Path]:
    return modules()


def _imports_of(module: str) -> frozenset[str]:
    return imports_of(module, type_checking=False)


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


def test_architecture_every_module_has_a_layer() -> None:
    for module in _files():
        assert any(module == p or module.startswith(p + ".") for p in LAYERS), (
            f"{module} has no layer in tests/test_architecture.py LAYERS; add it where docs/architecture.md's Layers section puts it")


def test_architecture_no_upward_imports() -> None:
    bad = _upward_imports()
    assert bad == set(), "imports against the layers: " + ", ".join(f"{a} -> {b}" for a, b in sorted(bad))


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


def test_architecture_no_file_or_def_over_the_size_cap() -> None:
    """One test lists every file and def over its cap: a cap is an alarm to split by concept."""
    over = []
    for path in _files().values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            over.append(f"{path.relative_to(SRC)} ({lines} lines)")
        over += _long_defs(path)
    assert over == [], (f"over the caps ({MAX_FILE_LINES} lines a file, {MAX_DEF_LINES} a def, docstring "
                        "included): split them by concept, not by reflowing: " + "; ".join(over))


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
            targets = import_targets(node, module, is_package)
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


def test_architecture_modules_import_only_listed_public_names() -> None:
    bad = []
    for module in sorted(_files()):
        for source, name in _names_imported_from_modules(module):
            if name.startswith("__") and name.endswith("__"):
                continue
            if name.startswith("_"):
                if not _shares_package(module, source):
                    bad.append(f"{module} imports the private {source}.{name} from another package: make it public")
                continue
            listed = _declared_all(source)
            if listed is None or name not in listed:
                bad.append(f"{module} imports {name}, missing from {source}.__all__")
    assert bad == [], "; ".join(bad)


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


ARCHITECTURE_DOC = SRC.parent / "docs" / "architecture.md"
DESCRIPTION_COLUMN = 20
"""In the layout block a line indented this far or more continues the entry above it."""


def _doc_block(heading: str, text: str | None = None) -> list[str]:
    """The lines of the first fenced block under ``## heading`` of docs/architecture.md."""
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8") if text is None else text
    found = re.search(rf"^## {re.escape(heading)}\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert found, f"docs/architecture.md has no fenced block under '## {heading}'"
    return found.group(1).splitlines()


def _layout_entries(lines: list[str]) -> dict[str, str]:
    """The layout block read as {path under src/ampkit ('telemetry/' for a directory): its description}."""
    entries: dict[str, str] = {}
    directories: list[tuple[int, str]] = []  # (indent, path) of the directory entries enclosing a line
    current = ""
    for line in lines[1:]:  # the first line is src/ampkit/ itself
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= DESCRIPTION_COLUMN:
            entries[current] += " " + line.strip()
            continue
        name, _, description = line.strip().partition(" ")
        while directories and directories[-1][0] >= indent:
            directories.pop()
        current = (directories[-1][1] if directories else "") + name
        entries[current] = description.strip()
        if name.endswith("/"):
            directories.append((indent, current))
    return entries


def _names(description: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", description) is not None


def _unnamed_files(entries: dict[str, str], files: list[str]) -> list[str]:
    """Files (paths under src/ampkit) that the layout names nowhere: a file is named by a line of its
    own, or in the description of the deepest directory entry above it (a package's __init__.py by
    its directory's line)."""
    unnamed = []
    for rel in files:
        if rel in entries:
            continue
        parts = rel.split("/")
        depth = next((d for d in range(len(parts) - 1, 0, -1) if "".join(p + "/" for p in parts[:d]) in entries), 0)
        if depth == 0:
            unnamed.append(rel)
            continue
        if parts[-1] == "__init__.py" and depth == len(parts) - 1:
            continue
        description = entries["".join(p + "/" for p in parts[:depth])]
        rest = "/".join(parts[depth:])
        candidates = {rest, rest.removesuffix(".py"), parts[-1], parts[-1].removesuffix(".py")}
        if not any(_names(description, c) for c in candidates):
            unnamed.append(rel)
    return unnamed


def _src_files() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def test_architecture_every_src_file_is_named_in_the_layout() -> None:
    unnamed = _unnamed_files(_layout_entries(_doc_block("Layout")), _src_files())
    assert unnamed == [], ("files under src/ampkit that docs/architecture.md's Layout names nowhere: "
                           f"{unnamed}; add each to its directory's line (or a line of its own)")


def test_architecture_layout_names_no_missing_path() -> None:
    stale = sorted(e for e in _layout_entries(_doc_block("Layout")) if not (PACKAGE / e).exists())
    assert stale == [], f"docs/architecture.md's Layout has lines for paths src/ampkit does not have: {stale}"


def test_architecture_layout_check_fails_for_a_file_without_a_line() -> None:
    layout = ["src/ampkit/", "  precision.py        Precision", "  diagnose/",
              "    core/             shared: stats (ranges), modules", "                      (hooks)"]
    entries = _layout_entries(layout)
    assert entries["diagnose/core/"] == "shared: stats (ranges), modules (hooks)"
    files = ["precision.py", "diagnose/__init__.py", "diagnose/core/stats.py", "diagnose/core/modules.py",
             "diagnose/core/ranges2.py", "diagnose/core/new.py", "diagnose/task.py", "scaler.py"]
    assert _unnamed_files(entries, files) == ["diagnose/core/ranges2.py", "diagnose/core/new.py",
                                              "diagnose/task.py", "scaler.py"]


def _doc_layers() -> dict[str, int]:
    """The Layers table of docs/architecture.md as {module: layer} (lint's line stands apart)."""
    layers: dict[str, int] = {}
    for line in _doc_block("Layers"):
        row = re.match(r"\s*(\d+)\s+(.*)", line)
        for token in row.group(2).split() if row else []:
            if token.endswith(("/", ".py")):
                module = "ampkit" if token == "ampkit/__init__.py" else (
                    "ampkit." + token.rstrip("/").removesuffix(".py").replace("/", "."))
                layers[module] = int(row.group(1))
    return layers


def test_architecture_layer_table_of_the_docs_equals_layers() -> None:
    assert _doc_layers() == LAYERS
