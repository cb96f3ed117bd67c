"""The ``ampkit.doctor/1`` JSON document (``src/ampkit/schemas/doctor.schema.json``).

``doctor_document`` is its one builder, for the live, step and script doctors alike: the schema,
the findings worst first, the environment, then the sections of the doctor that wrote it.
Non-finite floats follow the doctor schema's policy (``ampkit._util.jsonfloat.NONFINITE_AS_STRING``).
``write_json`` writes it through ``ampkit._util.io.atomic_write_bytes`` (temp file, fsync, rename):
a crash never leaves half a report.

>>> from ampkit.findings import Finding
>>> f = Finding(code="FORWARD_NAN", severity="error", message="m", fix="f", evidence={"x": float("inf")})
>>> doc = doctor_document([f], {"device": "cpu"}, precision="fp16")
>>> list(doc), doc["findings"][0]["evidence"], doc["precision"]
(['schema', 'findings', 'environment', 'precision'], {'x': 'inf'}, 'fp16')
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

__all__ = ["SCHEMA", "doctor_document", "write_json"]

SCHEMA = "ampkit.doctor/1"


def doctor_document(source: DiagnosisResult | Sequence[Finding], environment: dict[str, Any] | None = None,
                    **sections: Any) -> dict[str, Any]:
    """The ``ampkit.doctor/1`` document of ``source``'s findings, with ``sections`` after them.

    ``source``: a list of findings (the live doctor's), or a ``DiagnosisResult`` (the step doctor's,
    and the merged one of a script run), whose ``sections()`` come first.  ``environment`` None:
    the result's own, else this machine's (``ampkit.env.collect_environment``).
    """
    if isinstance(source, DiagnosisResult):
        findings, sections = source.findings, {**source.sections(), **sections}
        environment = environment if environment is not None else source.environment
    else:
        findings = list(source)
    if environment is None:
        from ampkit.env import collect_environment

        environment = collect_environment()
    return to_json({"schema": SCHEMA, "findings": [f.to_dict() for f in sort_findings(list(findings))],
                    "environment": environment, **sections}, NONFINITE_AS_STRING)


def write_json(path: str | os.PathLike[str], document: DiagnosisResult | Sequence[Finding] | dict[str, Any],
               environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the ``ampkit.doctor/1`` JSON atomically; returns the document written.

    ``document``: one ``doctor_document`` built (written as it is), or what it builds one from.
    """
    doc = document if isinstance(document, dict) else doctor_document(document, environment)
    atomic_write_bytes(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())
    return doc
