"""PatchSet: reversible patches of classes and modules."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ampkit.diagnose.script.patches import PatchSet


class _Base:
    def method(self) -> str:
        return "base"


class _Child(_Base):
    pass


def test_doctor_observers_patchset_restores_inherited_and_own_attributes() -> None:
    patches = PatchSet()
    patches.wrap(_Child, "method", lambda orig: lambda self: "wrapped " + orig(self))
    patches.replace(math, "pi", 3.0)
    assert _Child().method() == "wrapped base" and math.pi == 3.0
    patches.restore()
    assert "method" not in vars(_Child), "an inherited attribute must not be left as an own attribute"
    assert _Child().method() == "base" and math.pi == pytest.approx(3.14159, abs=1e-5)
    assert len(patches) == 0


def test_patchset_after_import_patches_a_module_when_the_script_imports_it_and_removes_its_finder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ampkit_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    patches = PatchSet()
    finders = list(sys.meta_path)
    patches.after_import("ampkit_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == [] and "ampkit_probe_mod" not in sys.modules  # not imported by the doctor itself
    try:
        import ampkit_probe_mod  # noqa: F401
        assert seen == [1]
    finally:
        patches.restore()
        sys.modules.pop("ampkit_probe_mod", None)
    assert sys.meta_path == finders


def test_patchset_after_import_patches_an_already_imported_module_at_once() -> None:
    seen: list[str] = []
    PatchSet().after_import("math", lambda m: seen.append(m.__name__))
    assert seen == ["math"]


def test_wrap_records_which_python_function_each_wrapper_wraps_and_keeps_it_after_restore() -> None:
    patches = PatchSet()

    def make(orig):  # type: ignore[no-untyped-def]
        def wrapper(*args):  # type: ignore[no-untyped-def]
            return orig(*args)
        return wrapper

    patches.wrap(_Child, "method", make)
    patches.wrap(math, "sqrt", make)  # a C function has no code: nothing to record
    wrapper_code = vars(_Child)["method"].__code__
    patches.restore()
    assert patches.wrapped == {wrapper_code: {_Base.method.__code__}}
