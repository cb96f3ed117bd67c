"""verify/record.py: the run record's type names exactly the schema's run object."""

from __future__ import annotations

from ampkit.verify.record import RunRecord, run_record
from ampkit.verify.report import load_schema


def test_run_record_keys_are_the_schema_run_properties() -> None:
    run = load_schema()["$defs"]["run"]
    assert set(RunRecord.__annotations__) == set(run["properties"])
    assert set(run["required"]) <= RunRecord.__required_keys__


def test_run_record_completes_a_failed_run_with_every_required_key_after_its_own() -> None:
    raw = {"precision": "fp16", "device": "cpu", "status": "failed", "error": "the worker process died from SIGKILL"}
    record = run_record(dict(raw))
    assert set(record) == set(RunRecord.__required_keys__)
    assert list(record)[:4] == list(raw) and record["error"] == raw["error"]
