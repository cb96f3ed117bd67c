"""``ampkit.lint`` as a package: its public face, and what its modules may take from each other.

Each module's ``__all__`` lists every name another lint module imports from it, and no module
imports another's private (``_name``) names: a helper two modules need is public in one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ampkit.lint

SRC = Path(ampkit.lint.__file__).resolve().parents[2]
MODULES = {
    ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
    for p in sorted((SRC / "ampkit" / "lint").rglob("*.py"))
}


def _all_of(module: str) -> set[str] | None:
    for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _imported_names(module: str) -> list[tuple[str, str]]:
    """(lint module, name) for each ``from ampkit.lint.X import name`` in ``module`` (submodules excluded)."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module in MODULES:
            found.extend((node.module, a.name) for a in node.names if f"{node.module}.{a.name}" not in MODULES)
    return found


def test_init_public_names_resolve() -> None:
    for name in ampkit.lint.__all__:
        assert getattr(ampkit.lint, name) is not None, name


@pytest.mark.parametrize("module", sorted(MODULES))
def test_init_every_module_declares_all(module: str) -> None:
    assert _all_of(module) is not None, f"{module} has no __all__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_init_modules_import_only_listed_public_names(module: str) -> None:
    for source, name in _imported_names(module):
        assert not name.startswith("_"), f"{module} imports the private {source}.{name}: make it public"
        assert name in (_all_of(source) or set()), f"{module} imports {name}, missing from {source}.__all__"
