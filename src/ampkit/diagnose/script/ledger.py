"""The script doctor's findings ledger: one finding per ``(code, key)``, later occurrences counted."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ampkit.findings import CODES, SEVERITY_ORDER, Code, Finding, Severity

__all__ = ["Ledger"]


@dataclass
class _Entry:
    code: Code
    severity: Severity
    message: str
    fix: str
    module: str | None
    op: str | None
    location: str | None
    step: int | None
    evidence: dict[str, Any]
    count: int = 1
    steps: list[int] = field(default_factory=list)


class Ledger:
    """Findings keyed by ``(code, key)``: the first occurrence is kept, later ones are counted.

    >>> led = Ledger()
    >>> [led.add("CLIP_BEFORE_UNSCALE", message="clipped scaled gradients", fix="unscale first", step=s)
    ...  for s in range(3)]
    [True, False, False]
    >>> [(f.code, f.step, f.evidence["occurrences"]) for f in led.findings()]
    [('CLIP_BEFORE_UNSCALE', 0, 3)]
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, Any], _Entry] = {}
        self._lock = threading.Lock()
        """Findings arrive from every thread that trains: a lookup and its insert or count are one step."""

    def add(self, code: Code, *, message: str, fix: str, key: Any = None, severity: Severity | None = None,
            module: str | None = None, op: str | None = None, location: str | None = None,
            step: int | None = None, evidence: dict[str, Any] | None = None) -> bool:
        """Record a finding; returns True when it is the first of its ``(code, key)``."""
        if code not in CODES:
            raise ValueError(f"unknown finding code {code!r}")
        with self._lock:
            return self._add(code, message=message, fix=fix, key=key, severity=severity, module=module, op=op,
                             location=location, step=step, evidence=evidence)

    def _add(self, code: Code, *, message: str, fix: str, key: Any, severity: Severity | None, module: str | None,
             op: str | None, location: str | None, step: int | None, evidence: dict[str, Any] | None) -> bool:
        entry = self._entries.get((code, key))
        if entry is not None:
            entry.count += 1
            if step is not None and len(entry.steps) < 32:
                entry.steps.append(step)
            if severity is not None and SEVERITY_ORDER[severity] < SEVERITY_ORDER[entry.severity]:
                entry.severity = severity
            return False
        self._entries[(code, key)] = _Entry(
            code=code, severity=severity or CODES[code], message=message, fix=fix, module=module, op=op,
            location=location, step=step, evidence=dict(evidence or {}),
            steps=[step] if step is not None else [],
        )
        return True

    def fold(self, code: str, key: Any, consequence: dict[str, Any], *, limit: int = 32) -> bool:
        """Append ``consequence`` to the ``consequences`` evidence of the finding ``(code, key)`` (what it
        caused on later steps, reported there instead of as findings of their own); False when there is none."""
        with self._lock:
            entry = self._entries.get((code, key))
            if entry is None:
                return False
            folded = entry.evidence.setdefault("consequences", [])
            if len(folded) < limit:
                folded.append(consequence)
            return True

    def has(self, code: str, *, acting: bool = False, key: Any = None) -> bool:
        """Whether ``code`` was recorded (under ``key``, when given); with ``acting``, only as an error or a
        warning (not a borderline or other info row)."""
        with self._lock:
            return any(c == code and (key is None or k == key) and not (acting and e.severity == "info")
                       for (c, k), e in self._entries.items())

    def findings(self) -> list[Finding]:
        out = []
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            evidence = dict(e.evidence)
            evidence["occurrences"] = e.count
            if len(e.steps) > 1:
                evidence["steps"] = e.steps
            out.append(Finding(code=e.code, severity=e.severity, message=e.message, fix=e.fix, module=e.module,
                               op=e.op, location=e.location, step=e.step, evidence=evidence))
        return out

    def __len__(self) -> int:
        return len(self._entries)
