"""The ``ampkit.doctor/1`` JSON document (``src/ampkit/schemas/doctor.schema.json``).

``write_json`` writes it through ``ampkit._util.io.atomic_write_bytes`` (temp file, fsync,
rename): a crash never leaves half a report.  Non-finite floats follow the doctor schema's
policy (``ampkit._util.jsonfloat.NONFINITE_AS_STRING``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.step.result import SCHEMA, DiagnosisResult
from ampkit.findings import Finding

__all__ = ["doctor_document", "write_json"]


def doctor_document(result_or_findings: DiagnosisResult | Sequence[Finding] | dict[str, Any],
                    environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ampkit.doctor/1`` document for a result, a list of findings, or a finished document."""
    from ampkit.env import collect_environment

    if isinstance(result_or_findings, DiagnosisResult):
        return result_or_findings.to_json(environment)
    if isinstance(result_or_findings, dict):
        doc = dict(result_or_findings)
        doc.setdefault("schema", SCHEMA)
        if environment is not None or "environment" not in doc:
            doc["environment"] = environment if environment is not None else collect_environment()
        return to_json(doc, NONFINITE_AS_STRING)
    findings = sort_findings(list(result_or_findings))
    return to_json({"schema": SCHEMA, "findings": [f.to_dict() for f in findings],
                    "environment": environment if environment is not None else collect_environment()},
                   NONFINITE_AS_STRING)


def write_json(path: str | os.PathLike[str], result_or_findings: DiagnosisResult | Sequence[Finding] | dict[str, Any],
               environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the ``ampkit.doctor/1`` JSON atomically; returns the document written."""
    doc = doctor_document(result_or_findings, environment)
    atomic_write_bytes(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())
    return doc
