"""Preflight with emulated GEMMs (``emulate=True``) gives the verdicts and policies of the real low-precision
replay (``emulate=False``) on every case of the preflight corpus, in fp16, bf16 and fp8; the report says which
GEMMs it ran."""

from __future__ import annotations

import io
import json
from importlib import resources

import jsonschema
import pytest
import torch

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.document import preflight_document
from ampkit.diagnose.preflight.judge import quiet_fp8_warnings
from ampkit.diagnose.preflight.result import PreflightResult
from ampkit.diagnose.preflight.table import render_summary
from ampkit.precision import FormatName
from tests.helpers.preflight_judge import case_names, load_case

pytestmark = pytest.mark.numerics

FORMATS = ("fp16", "bf16", "fp8")


@pytest.fixture(scope="module", params=case_names())
def replays(request: pytest.FixtureRequest) -> dict[bool, PreflightResult]:
    """One case's preflight with its GEMMs native (False) and emulated (True), on the same model and batches
    (its first ``preflight_batches``, as tests/diagnose/preflight/test_corpus.py replays them)."""
    pytest.importorskip("torchao")
    task = load_case(request.param)
    model = task.build_model(0)
    stream = task.batches(0, torch.device("cpu"))
    batches = [next(stream) for _ in range(getattr(task, "preflight_batches", 1))]
    with quiet_fp8_warnings():
        return {emulate: preflight_model(model, batches, loss_fn=task.loss, formats=FORMATS, emulate=emulate)
                for emulate in (False, True)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_preflight_emulated_gemms_give_the_native_verdict_and_policy(replays: dict[bool, PreflightResult],
                                                                     fmt: FormatName) -> None:
    native, emulated = replays[False].report(fmt), replays[True].report(fmt)
    assert (native.gemm, emulated.gemm) == ("native", "emulated")
    assert (emulated.verdict, emulated.policy) == (native.verdict, native.policy)


def test_preflight_document_and_table_say_which_gemms_ran(replays: dict[bool, PreflightResult]) -> None:
    schema = json.loads(resources.files("ampkit").joinpath("schemas/preflight.schema.json").read_text())
    for emulate, result in replays.items():
        doc = preflight_document(result)
        jsonschema.validate(doc, schema)
        assert {f["gemm"] for f in doc["formats"]} == {"emulated" if emulate else "native"}
        table = io.StringIO()
        render_summary(result, file=table)
        assert ("gemm emulated in fp32" in table.getvalue()) is emulate
