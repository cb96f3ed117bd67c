"""src/ampkit's import graph, read with ``ast`` at module granularity (the architecture and import-graph tests).

Module ``a`` imports ``b`` when it imports ``b`` or a name from it, at module level or inside a function;
``from pkg import sub`` imports the submodule ``sub`` when it is one, else ``pkg``.  Whether the imports of
``if TYPE_CHECKING:`` blocks count is the caller's choice: the layer check leaves them out (an annotation
may name a higher layer), the circle check counts them (a circle of type-only imports is still one).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "ampkit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of src/ampkit by its dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The module ``name`` names, or its closest enclosing module (``ampkit.hooks.EngineHook`` -> ``ampkit.hooks``)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The ampkit modules or names one import statement of ``module`` names (others are left out)."""
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
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules() else target for a in node.names]


@cache
def imports_of(module: str, *, type_checking: bool) -> frozenset[str]:
    """Every ampkit module that ``module``'s source imports; ``type_checking``: count ``if TYPE_CHECKING:`` blocks."""
    path = modules()[module]
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(child: ast.AST) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in import_targets(child, module, is_package):
                resolved = resolve(target)
                if resolved is not None and resolved != module:
                    found.add(resolved)
        visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(found)
