"""The script doctor's findings ledger: one finding per ``(code, key)``, later occurrences counted."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from ampkit.findings import SEVERITY_ORDER, Code, Finding

__all__ = ["Ledger"]


@dataclass
class _Entry:
    finding: Finding
    """The first occurrence (its severity raised by later, worse ones)."""
    count: int = 1
    steps: list[int] = field(default_factory=list)


class Ledger:
    """Findings keyed by ``(code, key)``: the first occurrence is kept, later ones are counted.

    >>> from ampkit.findings import Finding
    >>> led = Ledger()
    >>> [led.add(Finding(code="CLIP_BEFORE_UNSCALE", severity="error", message="clipped scaled gradients",
    ...                  fix="unscale first", step=s)) for s in range(3)]
    [True, False, False]
    >>> [(f.code, f.step, f.evidence["occurrences"]) for f in led.findings()]
    [('CLIP_BEFORE_UNSCALE', 0, 3)]
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, Any], _Entry] = {}
        self._lock = threading.Lock()
        """Findings arrive from every thread that trains: a lookup and its insert or count are one step."""

    def add(self, finding: Finding, *, key: Any = None) -> bool:
        """Record ``finding`` under ``(finding.code, key)``; returns True when it is the first of its key.

        A later one is counted (its step listed, once), and raises the kept finding's severity when it is worse.
        """
        with self._lock:
            entry = self._entries.get((finding.code, key))
            if entry is None:
                # The ledger's own copy of the evidence: fold() appends to it.
                kept = dataclasses.replace(finding, evidence=dict(finding.evidence))
                self._entries[(finding.code, key)] = _Entry(kept, steps=[] if kept.step is None else [kept.step])
                return True
            entry.count += 1
            if finding.step is not None and finding.step not in entry.steps and len(entry.steps) < 32:
                entry.steps.append(finding.step)
            if SEVERITY_ORDER[finding.severity] < SEVERITY_ORDER[entry.finding.severity]:
                entry.finding = dataclasses.replace(entry.finding, severity=finding.severity)
            return False

    def fold(self, code: str, key: Any, consequence: dict[str, Any], *, limit: int = 32) -> bool:
        """Append ``consequence`` to the ``consequences`` evidence of the finding ``(code, key)`` (what it
        caused on later steps, reported there instead of as findings of their own); False when there is none."""
        with self._lock:
            entry = self._entries.get((code, key))
            if entry is None:
                return False
            folded = entry.finding.evidence.setdefault("consequences", [])
            if len(folded) < limit:
                folded.append(consequence)
            return True

    def has(self, code: Code, *, acting: bool = False, key: Any = None) -> bool:
        """Whether ``code`` was recorded (under ``key``, when given); with ``acting``, only as an error or a
        warning (not a borderline or other info row)."""
        with self._lock:
            return any(c == code and (key is None or k == key) and not (acting and e.finding.severity == "info")
                       for (c, k), e in self._entries.items())

    def findings(self) -> list[Finding]:
        """Every kept finding, its evidence counting its ``occurrences`` (and listing their ``steps``)."""
        with self._lock:
            entries = [(e.finding, e.count, list(e.steps)) for e in self._entries.values()]
        out = []
        for f, count, steps in entries:
            evidence = {**f.evidence, "occurrences": count}
            if len(steps) > 1:
                evidence["steps"] = steps
            out.append(dataclasses.replace(f, evidence=evidence))
        return out

    def __len__(self) -> int:
        return len(self._entries)
