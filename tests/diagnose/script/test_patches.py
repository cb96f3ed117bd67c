"""PatchSet: reversible patches of classes and modules."""

from __future__ import annotations

import math

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
