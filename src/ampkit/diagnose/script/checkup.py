"""The record of the end-of-run *checkup*: the last captured step replayed against an fp32 copy.

A run whose checkup did not happen must not read like a run that was checked.  The record is
the doctor JSON's ``checkup`` object (``src/ampkit/schemas/doctor.schema.json``):

* ``ran``: true only when the step was replayed *and* compared with its fp32 shadow;
* ``status``: ``ran``; ``no_fp32`` (the low-precision replay ran, the fp32 copy could not);
  ``failed`` (the replay raised); ``skipped`` (not attempted: turned off, a replay of a failing
  step already found errors, a signal ended the run, no model forward was seen, an fp32 step);
* ``step``: the optimizer step replayed (the capture's step), or None when no forward was seen;
* ``precision``: the precision it replayed in (``ran``/``no_fp32``), else None;
* ``reason``: why it did not run or was not compared (None when it ran).

>>> checkup_record("failed", 20, "RuntimeError: boom")["ran"]
False
>>> checkup_note(checkup_record("failed", 20, "RuntimeError: boom"))
'the fp32 checkup of step 20 could not run (RuntimeError: boom): this run was not compared with fp32'
>>> checkup_note(checkup_record("skipped", 20, "turned off (--no-checkup)")) is None
True
"""

from __future__ import annotations

from typing import Any, Literal

from ampkit.diagnose.step.result import DiagnosisResult

__all__ = ["CheckupStatus", "checkup_note", "checkup_ran", "checkup_record", "checkup_skipped_reason"]

_REASON_CHARS = 300

CheckupStatus = Literal["ran", "no_fp32", "failed", "skipped"]
"""The ``status`` of a checkup record (the doctor JSON schema's enum)."""


def checkup_record(status: CheckupStatus, step: int | None, reason: str | None, precision: str | None = None) -> dict[str, Any]:
    """The record of a checkup: ``failed`` (the replay raised: ``reason`` is the error) or ``skipped`` (not
    attempted: ``reason`` says why); ``checkup_ran`` makes those of a replay that returned."""
    first = reason.splitlines()[0][:_REASON_CHARS] if reason else None
    return {"ran": status == "ran", "status": status, "step": step, "precision": precision, "reason": first}


def checkup_ran(result: DiagnosisResult) -> dict[str, Any]:
    """The record of a checkup replay that returned: ``ran``, or ``no_fp32`` when its shadow could not run."""
    shadow_error = result.comparison.get("shadow_unavailable")
    if shadow_error:
        return checkup_record("no_fp32", result.step, f"the fp32 copy could not run the step ({shadow_error})",
                              result.precision)
    return checkup_record("ran", result.step, None, result.precision)


def checkup_skipped_reason(*, enabled: bool, signal: str | None, errors: bool, observed: bool,
                           corrupted_at: int | None = None) -> str | None:
    """Why the checkup is not attempted, or None when it is; ``corrupted_at``: the step whose non-finite
    gradients a diagnosed finding explains were applied (a later step replays only their consequences)."""
    if not enabled:
        return "turned off (--no-checkup or --no-replay)"
    if signal is not None:
        return f"the run was ended by {signal.upper()}"
    if errors:
        return "a replay of a failing step already found errors"
    if corrupted_at is not None:
        return f"step {corrupted_at} wrote non-finite gradients into the weights, for the reason found there"
    if not observed:
        return "no model forward was observed"
    return None


def checkup_note(record: dict[str, Any]) -> str | None:
    """The terminal summary's words for a checkup that was attempted but not compared with fp32, else None
    (a skipped checkup is explained by the rest of the report: errors, a signal, an fp32 run)."""
    if not record or record.get("status") not in ("failed", "no_fp32"):
        return None
    return (f"the fp32 checkup of step {record.get('step')} could not run ({record.get('reason')}): "
            "this run was not compared with fp32")
