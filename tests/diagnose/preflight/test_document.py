"""The ampkit.preflight/1 document: valid against its schema, non-finite numbers as strings, written atomically."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.document import SCHEMA, preflight_document, write_preflight_json
from tests.diagnose.preflight.models import OVERFLOW_GAIN, Stack, batches, loss

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def result():
    torch.manual_seed(0)
    return preflight_model(Stack(OVERFLOW_GAIN), batches(), loss_fn=loss, formats="fp16,fp8", environment=True)


def _schema() -> dict:
    return json.loads(resources.files("ampkit").joinpath("schemas/preflight.schema.json").read_text())


def test_preflight_document_is_valid_against_its_schema(result) -> None:
    doc = preflight_document(result)
    jsonschema.validate(doc, _schema())
    assert doc["schema"] == SCHEMA
    assert [f["format"] for f in doc["formats"]] == ["fp16", "fp8"]


def test_preflight_document_spells_a_broken_replays_sqnr_as_the_string_minus_inf(result) -> None:
    fp16 = preflight_document(result)["formats"][0]
    assert fp16["verdict"] == "policy"
    assert fp16["policy_sqnr_db"]["before"] == "-inf"
    assert fp16["policy"] == {"keep_fp32": ["blocks.2.wo"], "fp8_filter": [], "init_scale": None}
    assert fp16["first_break"]["module"] == "blocks.2.wo" and fp16["first_break"]["op"] == "aten::addmm"


def test_write_preflight_json_leaves_no_temp_file_and_strict_json(result, tmp_path: Path) -> None:
    path = tmp_path / "preflight.json"
    write_preflight_json(result, path)
    assert [p.name for p in tmp_path.iterdir()] == ["preflight.json"]
    json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
