"""Ledger: the script doctor's findings, one per (code, key)."""

from __future__ import annotations

import pytest

from ampkit.diagnose.script.ledger import Ledger


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
