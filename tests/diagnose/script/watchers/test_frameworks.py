"""The framework watcher: TrainingArguments(fp16=True) on a CPU, seen however the script builds it."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampkit.diagnose.script.mixed import mixed_precision_record
from ampkit.diagnose.script.runner import run_script
from ampkit.diagnose.script.services.frameworks import FrameworkRequest
from ampkit.diagnose.script.watchers.frameworks import FrameworkWatch
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
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    at = f"{Path(__file__).relative_to(Path.cwd())}:{main.__code__.co_firstlineno + 1}"
    assert f.location == at and f.evidence["what"] == "framework"
    assert f.message.startswith(f"TrainingArguments(fp16=True) (built at {at}) asks for mixed precision")
    assert "only on an accelerator" in f.message and "trained in fp32" in f.message
    # transformers 5.x and Accelerate 1.x print nothing about it, not even at debug verbosity
    assert "without a warning or a log line" in f.message and "with only a log line" not in f.message
    assert "TrainingArguments(bf16=True)" in f.fix
    requested = mixed_precision_record(ctx, {})["requested"]
    assert requested["amp"] is True
    assert requested["frameworks"] == [{"setting": "TrainingArguments(fp16=True)", "dtype": "fp16", "location": at,
                                        "framework": "Trainer"}]


def test_framework_watch_reports_nothing_for_trainer_bf16_on_cpu(hf_helpers: object, tmp_path: Path) -> None:
    ctx = observe(lambda: hf_helpers.trainer(tmp_path, steps=1, bf16=True).train())  # type: ignore[attr-defined]
    assert [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"] == []
    assert ctx.state.frameworks.requests[0].setting == "TrainingArguments(bf16=True)"


def test_framework_watch_alone_records_the_training_arguments_that_ask_for_low_precision(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    with watching(FrameworkWatch) as w:
        TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
        line = sys._getframe().f_lineno + 1
        TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], bf16=True)
    at = f"{Path(__file__).relative_to(Path.cwd())}:{line}"
    assert w.state.frameworks.requests == [FrameworkRequest("TrainingArguments(bf16=True)", "bf16", at, "Trainer")]


# -- Accelerate ---------------------------------------------------------------------------------------------
@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in a process-wide singleton: each test starts and ends with a fresh one."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        state.AcceleratorState._reset_state(True)


def _accelerate_loop(**kw: Any) -> int:
    """Two steps of an nlp_example-style loop (Accelerator, prepare, accelerator.backward); returns the line
    that built the Accelerator."""
    from accelerate import Accelerator

    line = sys._getframe().f_lineno + 1
    accelerator = Accelerator(cpu=True, **kw)
    model, opt = accelerator.prepare(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    for _ in range(2):
        accelerator.backward(model(torch.randn(3, 4)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return line


def _here(line: int) -> str:
    return f"{Path(__file__).relative_to(Path.cwd())}:{line}"


def test_mixed_precision_off_reports_accelerator_fp16_on_cpu(accelerate_state: None) -> None:
    lines: list[int] = []
    ctx = observe(lambda: lines.append(_accelerate_loop(mixed_precision="fp16")))
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    assert f.location == _here(lines[0]) and f.evidence["framework"] == "Accelerate"
    assert f.message.startswith(f"Accelerator(mixed_precision='fp16') (built at {_here(lines[0])}) asks for")
    assert "trained in fp32" in f.message and "mixed_precision='bf16'" in f.fix
    assert mixed_precision_record(ctx, {})["requested"]["amp"] is True


def test_framework_watch_records_accelerate_bf16_on_cpu_without_a_finding(accelerate_state: None) -> None:
    ctx = observe(lambda: _accelerate_loop(mixed_precision="bf16"))
    assert [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"] == []
    assert [(r.setting, r.dtype) for r in ctx.state.frameworks.requests] == [("Accelerator(mixed_precision='bf16')", "bf16")]
    assert mixed_precision_record(ctx, {})["actual"]["autocast_dtypes"] == ["bf16"]


def test_mixed_precision_off_names_the_accelerate_environment_variable(
        accelerate_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    ctx = observe(_accelerate_loop)
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    assert f.message.startswith("ACCELERATE_MIXED_PRECISION=fp16 in the environment")
    assert "ACCELERATE_MIXED_PRECISION=bf16" in f.fix
    assert f.evidence["setting"].startswith("ACCELERATE_MIXED_PRECISION=fp16")


def test_mixed_precision_off_names_accelerates_config_file_that_a_direct_run_ignores(
        accelerate_state: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    config = tmp_path / "default_config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\nuse_cpu: true\n")
    monkeypatch.setattr(config_args, "default_config_file", str(config))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    ctx = observe(_accelerate_loop)
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    assert f.message.startswith(f"mixed_precision: bf16 in accelerate's config file {config}, for the Accelerator")
    assert "accelerate launch" in f.message and "ACCELERATE_MIXED_PRECISION=bf16" in f.fix


# -- Lightning ----------------------------------------------------------------------------------------------
def _lightning_fit(precision: str | None, half: bool = False) -> None:
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            if half:
                self.net[2].half()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x).float() - y).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
    # The fp16 layer of ``half`` makes the first forward raise; the finding is made before that.
    with warnings.catch_warnings(), contextlib.suppress(RuntimeError if half else ()):
        warnings.simplefilter("ignore")  # Lightning's own about its fallback, num_workers, ...
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             **({"precision": precision} if precision else {}))
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))


def test_mixed_precision_off_reports_lightning_16_mixed_that_ran_bf16_on_cpu() -> None:
    ctx = observe(lambda: _lightning_fit("16-mixed"))
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    assert f.message.startswith("Trainer(precision='16-mixed') (built at ")
    assert "asks for fp16 mixed precision" in f.message and "bf16" in f.message.split("What ran:")[1]
    assert f.evidence["framework"] == "Lightning" and f.evidence["requested"] == "fp16" and f.evidence["ran"] == "bf16"
    assert "precision='bf16-mixed'" in f.fix


def test_mixed_precision_off_reports_lightning_16_mixed_taken_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_TRAINER_PRECISION", "16-mixed")  # Lightning's Trainer reads the arguments left out here
    ctx = observe(lambda: _lightning_fit(None))
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"]
    assert f.message.startswith("PL_TRAINER_PRECISION=16-mixed in the environment")
    assert f.evidence["requested"] == "fp16" and f.evidence["ran"] == "bf16"


def test_framework_watch_lightning_bf16_mixed_on_cpu_has_no_finding() -> None:
    ctx = observe(lambda: _lightning_fit("bf16-mixed"))
    assert [f for f in ctx.state.ledger.findings() if f.code == "MIXED_PRECISION_OFF"] == []
    assert [(r.setting, r.dtype) for r in ctx.state.frameworks.requests] == [("Trainer(precision='bf16-mixed')", "bf16")]


def test_low_precision_params_fix_under_lightning_names_trainer_precision() -> None:
    ctx = observe(lambda: _lightning_fit(None, half=True))
    (f,) = [f for f in ctx.state.ledger.findings() if f.code == "LOW_PRECISION_PARAMS"]
    assert "Trainer(precision=" in f.fix and "bf16=True" not in f.fix


_LIGHTNING_HALF = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.net[2].half()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=4))
"""


def test_dtype_mismatch_fix_under_lightning_names_trainer_precision(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    script = tmp_path / "train.py"
    script.write_text(_LIGHTNING_HALF)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_script(script, checkup=False, measure_speed=False)
    (f,) = [f for f in report.findings if f.code == "DTYPE_MISMATCH"]
    assert "drop `.half()`" in f.fix and "Trainer(precision='bf16-mixed'" in f.fix and "bf16=True" not in f.fix

