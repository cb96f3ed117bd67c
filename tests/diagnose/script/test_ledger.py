"""Ledger: the script doctor's findings, one per (code, key)."""

from __future__ import annotations

from ampkit.diagnose.script.ledger import Ledger
from ampkit.findings import Finding


def test_doctor_observers_ledger_keeps_first_and_escalates_severity() -> None:
    led = Ledger()
    low = {"code": "LOSS_IN_LOW_PRECISION", "fix": "f"}
    assert led.add(Finding(**low, severity="warning", message="first", step=3), key="a")
    assert not led.add(Finding(**low, severity="error", message="second", step=5), key="a")
    led.add(Finding(**low, severity="warning", message="other line"), key="b")
    [a, b] = led.findings()
    assert (a.message, a.severity, a.step, a.evidence["occurrences"], a.evidence["steps"]) == (
        "first", "error", 3, 2, [3, 5])
    assert (b.severity, b.evidence["occurrences"]) == ("warning", 1)


def test_doctor_observers_ledger_lists_a_repeated_step_once() -> None:
    led = Ledger()
    for step in (2, 5, 5):
        led.add(Finding(code="FORWARD_NAN", severity="error", message=f"at {step}", fix="f", module="x", step=step))
    [merged] = led.findings()
    assert (merged.message, merged.evidence["steps"], merged.evidence["occurrences"]) == ("at 2", [2, 5], 3)


def test_doctor_observers_ledger_takes_a_finding_and_folds_into_its_own_copy() -> None:
    led = Ledger()
    f = Finding(code="SCALE_COLLAPSE", severity="error", message="m", fix="x", step=2, evidence={"cause": "c"})
    assert led.add(f, key="k") and led.fold("SCALE_COLLAPSE", "k", {"step": 3})
    [kept] = led.findings()
    assert kept.evidence == {"cause": "c", "consequences": [{"step": 3}], "occurrences": 1}
    assert f.evidence == {"cause": "c"}  # the caller's finding is left as it was
