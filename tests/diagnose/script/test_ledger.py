"""Ledger: the script doctor's findings, one per (code, key)."""

from __future__ import annotations

import pytest

from ampkit.diagnose.script.ledger import Ledger
from ampkit.findings import Finding


def test_doctor_observers_ledger_keeps_first_and_escalates_severity() -> None:
    led = Ledger()
    assert led.add("LOSS_IN_LOW_PRECISION", key="a", message="first", fix="f", step=3)
    assert not led.add("LOSS_IN_LOW_PRECISION", key="a", message="second", fix="f", step=5, severity="error")
    led.add("LOSS_IN_LOW_PRECISION", key="b", message="other line", fix="f")
    [a, b] = led.findings()
    assert (a.message, a.severity, a.step, a.evidence["occurrences"], a.evidence["steps"]) == (
        "first", "error", 3, 2, [3, 5])
    assert (b.severity, b.evidence["occurrences"]) == ("warning", 1)
    with pytest.raises(ValueError, match="unknown finding code"):
        led.add("NOT_A_CODE", message="m", fix="f")


def test_doctor_observers_ledger_takes_a_finding_and_folds_into_its_own_copy() -> None:
    led = Ledger()
    f = Finding(code="SCALE_COLLAPSE", severity="error", message="m", fix="x", step=2, evidence={"cause": "c"})
    assert led.add(f, key="k") and led.fold("SCALE_COLLAPSE", "k", {"step": 3})
    [kept] = led.findings()
    assert kept.evidence == {"cause": "c", "consequences": [{"step": 3}], "occurrences": 1}
    assert f.evidence == {"cause": "c"}  # the caller's finding is left as it was
