"""The ``ampkit.doctor/1`` JSON document (``src/ampkit/schemas/doctor.schema.json``).

``doctor_document`` is its one builder, for the live, step and script doctors alike: the schema,
the findings worst first and the environment, then the replay's sections (a ``DiagnosisResult``'s
headroom, comparison, bisection ...), then the script run's (a ``ScriptReport``'s ``partial``,
``mixed_precision``, ``compiled`` ...).  Non-finite floats follow the doctor schema's policy
(``ampkit._util.jsonfloat.NONFINITE_AS_STRING``).  ``write_json`` writes it through
``ampkit._util.io.atomic_write_bytes`` (temp file, fsync, rename): a crash never leaves half a report.

>>> from ampkit.findings import Finding
>>> f = Finding(code="FORWARD_NAN", severity="error", message="m", fix="f", evidence={"x": float("inf")})
>>> doc = doctor_document([f], {"device": "cpu"})
>>> list(doc), doc["findings"][0]["evidence"]
(['schema', 'findings', 'environment'], {'x': 'inf'})
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.script.outcome import ScriptReport
from ampkit.diagnose.step.result import DiagnosisResult, Headroom
from ampkit.findings import Finding

__all__ = ["SCHEMA", "Source", "doctor_document", "write_json"]

SCHEMA = "ampkit.doctor/1"

Source = ScriptReport | DiagnosisResult | Sequence[Finding]
"""What a document is built from: a script run (``ampkit doctor SCRIPT``), one diagnosis (``diagnose_step``,
``ampkit doctor TASK``), or findings alone (the live doctor's ``ReplayDoctor.findings``)."""


def doctor_document(source: Source, environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ampkit.doctor/1`` document of ``source``.

    ``environment`` None: the script report's (this machine's, with the script, its exit status and
    scalers), else the result's own, else this machine's (``ampkit.env.collect_environment``).
    """
    report: ScriptReport | None = None
    result: DiagnosisResult | None = None
    if isinstance(source, ScriptReport):
        report, result = source, source.result()
        findings = result.findings
    elif isinstance(source, DiagnosisResult):
        result, findings = source, source.findings
    else:
        findings = list(source)
    if environment is None:
        environment = report.environment() if report is not None else result.environment if result is not None else None
    if environment is None:
        from ampkit.env import collect_environment

        environment = collect_environment()
    doc: dict[str, Any] = {"schema": SCHEMA, "findings": [f.to_dict() for f in sort_findings(findings)],
                           "environment": environment}
    if result is not None:
        doc.update({
            "precision": result.precision, "step": result.step, "keep_fp32": result.keep_fp32,
            "fp8_filter": result.fp8_filter, "loss": result.loss, "loss_fp32": result.loss_fp32,
            "module_headroom": _headroom(result.module_headroom), "grad_headroom": _headroom(result.grad_headroom),
            "comparison": result.comparison, "bisection": result.bisection,
        })
    if report is not None:
        doc["partial"] = report.partial
        if report.mixed_precision:
            doc["mixed_precision"] = report.mixed_precision
        doc["compiled"] = report.compiled
        if report.compiled_comparison is not None:
            doc["compiled_comparison"] = report.compiled_comparison
        if report.ended is not None:
            doc["ended"] = report.ended
        if report.checkup:
            doc["checkup"] = report.checkup
    return to_json(doc, NONFINITE_AS_STRING)


def _headroom(headroom: Headroom) -> dict[str, dict[str, list[float]]]:
    return {m: {k: list(v) for k, v in d.items()} for m, d in headroom.items()}


def write_json(path: str | os.PathLike[str], document: Source | dict[str, Any],
               environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the ``ampkit.doctor/1`` JSON atomically; returns the document written.

    ``document``: one ``doctor_document`` built (written as it is), or what it builds one from.
    """
    doc = document if isinstance(document, dict) else doctor_document(document, environment)
    atomic_write_bytes(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())
    return doc
