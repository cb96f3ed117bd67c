"""The ``ampkit.preflight/1`` JSON document (``src/ampkit/schemas/preflight.schema.json``) and its writer.

Non-finite floats follow the doctor schema's policy (``"inf"``, ``"-inf"``, ``"nan"`` as strings:
``ampkit._util.jsonfloat.NONFINITE_AS_STRING``); the file is written through
``ampkit._util.io.atomic_write_bytes`` (temp file, fsync, rename), so a crash never leaves half a document.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit.diagnose.preflight.result import FormatReport, PreflightResult

__all__ = ["SCHEMA", "preflight_document", "write_preflight_json"]

SCHEMA = "ampkit.preflight/1"


def preflight_document(result: PreflightResult) -> dict[str, Any]:
    """The document of ``result``: the schema, one entry per judged format, the environment and the inputs."""
    doc = {"schema": SCHEMA, "formats": [_format(f) for f in result.formats], "skipped": result.skipped,
           "environment": result.environment or {}, "inputs": result.inputs, "phases_s": result.phases}
    return to_json(doc, NONFINITE_AS_STRING)  # type: ignore[no-any-return]


def _format(report: FormatReport) -> dict[str, Any]:
    brk = report.first_break
    return {
        "format": report.format,
        "verdict": report.verdict,
        "emulated": report.emulated,
        "gemm": report.gemm,
        "first_break": None if brk is None else {"kind": brk.kind, "module": brk.module, "op": brk.op,
                                                 "location": brk.location, "reason": brk.reason},
        "policy": {"keep_fp32": report.policy.keep_fp32, "fp8_filter": report.policy.fp8_filter,
                   "init_scale": report.policy.init_scale},
        "policy_sqnr_db": report.policy_sqnr_db or None,
        "grad_sqnr_db": report.grad_sqnr_db,
        "recommended_init_scale": report.recommended_init_scale,
        "grad_underflow_at_init_scale": report.grad_underflow_at_init_scale,
        "layers": [dataclasses.asdict(layer) for layer in report.layers],
        "findings": report.findings,
        "seconds": report.seconds,
    }


def write_preflight_json(result: PreflightResult, path: str | os.PathLike[str]) -> None:
    """Write the document of ``result`` to ``path`` atomically."""
    text = json.dumps(preflight_document(result), indent=2, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
