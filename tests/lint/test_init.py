"""``ampkit.lint`` as a package: its public face, and what its modules may take from each other.

Every lint module declares ``__all__``; that it lists every name another module imports, and that no
private name crosses modules, is checked for all of src/ampkit by tests/test_architecture.py.
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


def test_init_public_names_resolve() -> None:
    for name in ampkit.lint.__all__:
        assert getattr(ampkit.lint, name) is not None, name


@pytest.mark.parametrize("module", sorted(MODULES))
def test_init_every_module_declares_all(module: str) -> None:
    assert _all_of(module) is not None, f"{module} has no __all__"
