"""The framework watcher: TrainingArguments(fp16=True) on a CPU, seen however the script builds it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ampkit.diagnose.script.mixed import mixed_precision_record
from ampkit.diagnose.script.watchers.frameworks import FrameworkRequest, FrameworkWatch
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HELPERS = Path(__file__).parents[3] / "integrations"


@pytest.fixture
def hf_helpers() -> object:
    sys.path.insert(0, str(HELPERS))
    try:
        import hf_helpers
    finally:
        sys.path.remove(str(HELPERS))
    return hf_helpers


def test_mixed_precision_off_reports_trainer_fp16_on_cpu_built_inside_a_function(
        hf_helpers: object, tmp_path: Path) -> None:
    def main() -> None:  # TrainingArguments lives in main(): no global of the script holds it
        hf_helpers.trainer(tmp_path, steps=2, fp16=True).train()  # type: ignore[attr-defined]

    ctx = observe(main)
    (f,) = [f for f in ctx.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    at = f"{Path(__file__).relative_to(Path.cwd())}:{main.__code__.co_firstlineno + 1}"
    assert f.location == at and f.evidence["what"] == "framework"
    assert f.message.startswith(f"TrainingArguments(fp16=True) (built at {at}) asks for mixed precision")
    assert "only on an accelerator" in f.message and "trained in fp32" in f.message
    assert "bf16=True" in f.fix
    requested = mixed_precision_record(ctx, {})["requested"]
    assert requested["amp"] is True
    assert requested["frameworks"] == [{"setting": "TrainingArguments(fp16=True)", "dtype": "fp16", "location": at,
                                        "framework": "Trainer"}]


def test_framework_watch_reports_nothing_for_trainer_bf16_on_cpu(hf_helpers: object, tmp_path: Path) -> None:
    ctx = observe(lambda: hf_helpers.trainer(tmp_path, steps=1, bf16=True).train())  # type: ignore[attr-defined]
    assert [f for f in ctx.ledger.findings() if f.code == "MIXED_PRECISION_OFF"] == []
    assert ctx.frameworks.requests[0].setting == "TrainingArguments(bf16=True)"


def test_framework_watch_alone_records_the_training_arguments_that_ask_for_low_precision(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    with watching(FrameworkWatch) as w:
        TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
        line = sys._getframe().f_lineno + 1
        TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], bf16=True)
    at = f"{Path(__file__).relative_to(Path.cwd())}:{line}"
    assert w.watcher.requests == [FrameworkRequest("TrainingArguments(bf16=True)", "bf16", at, "Trainer")]
