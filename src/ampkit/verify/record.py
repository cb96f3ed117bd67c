"""One precision's run record, as the worker writes it and ``ampkit.verify/1``'s ``runs`` hold it.

``RunRecord`` names every key of the schema's ``run`` object with its type; ``run_record`` gives a
run that ended early (a crash, a worker killed by the OS) every key the schema requires, with empty
values, so the report and the comparison read one shape whatever happened.  A ``TypedDict``, not a
dataclass: the record travels as JSON (worker -> result file -> report -> ``--baseline`` file), and
a dict keeps its key order, so the report's bytes are the worker's.

(No ``from __future__ import annotations`` here: Python 3.11's ``TypedDict`` reads ``NotRequired``
only from evaluated annotations, and the required keys are what ``run_record`` promises.)
"""

from typing import Any, Literal, NotRequired, TypedDict, cast

from ampkit.precision import PrecisionName

__all__ = ["RunRecord", "RunStatus", "run_record"]

RunStatus = Literal["ok", "failed", "diverged"]


class RunRecord(TypedDict):
    """One run (the JSON schema's ``$defs.run``; docs/verify.md describes each key)."""

    precision: PrecisionName
    device: str
    status: RunStatus
    error: str | None
    log_tail: str | None
    """The worker's last output lines when it did not end ``ok`` (None otherwise)."""
    loss: list[float | None]
    steps: list[dict[str, Any]]
    eval: dict[str, float | None]
    eval_history: list[dict[str, Any]]
    skipped_steps: int
    nonfinite_steps: int
    throughput: dict[str, Any]
    peak_memory_bytes: int | None
    memory: dict[str, Any] | None
    wall_s: float | None
    init_sha256: str | None
    data_sha256: str | None
    world_size: int
    traceback: NotRequired[str]
    settings: NotRequired[dict[str, Any]]
    shadow_loss: NotRequired[list[float | None]]
    launch: NotRequired[dict[str, Any]]
    scaling: NotRequired[dict[str, Any]]


def _empty() -> dict[str, Any]:
    return {
        "loss": [], "steps": [], "eval": {}, "eval_history": [], "skipped_steps": 0, "nonfinite_steps": 0,
        "throughput": {}, "peak_memory_bytes": None, "memory": None, "wall_s": None, "init_sha256": None,
        "data_sha256": None, "error": None, "log_tail": None, "world_size": 1,
    }


def run_record(raw: dict[str, Any]) -> RunRecord:
    """``raw`` (a worker's result, or ``precision``/``device``/``status``/``error`` of one that wrote
    none) with the keys it lacks added at the end, empty; ``raw`` itself is completed and returned.

    >>> r = run_record({"precision": "bf16", "device": "cpu", "status": "failed", "error": "killed"})
    >>> r["loss"], r["skipped_steps"], r["error"], list(r)[:4]
    ([], 0, 'killed', ['precision', 'device', 'status', 'error'])
    """
    for key, value in _empty().items():
        raw.setdefault(key, value)
    # The worker wrote it from the same keys (or the caller gave the four above): a JSON object
    # has no type to check against beyond the schema, which the report tests validate.
    return cast(RunRecord, raw)
