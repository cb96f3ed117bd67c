"""Where an explained exception happened: the kind of forward (from the model watcher's capture),
the optimizer steps before it, and the user's call chain."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.errors import explain_exception
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.where import Where, where_now, where_raised, where_sentence

FRAMES = UserFrames([Path(__file__).parent])


class Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x).half()
        return scores.masked_fill(scores > 0, -1e9)  # raises: -1e9 does not fit fp16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = Scores()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(x)


def _validate(model: nn.Module) -> None:
    model(torch.ones(2, 4))


def _raise_in_forward(model: nn.Module, *, train: bool, grad: bool) -> BaseException:
    watch = ModelWatch(on_root_forward=lambda cap: None, locate=FRAMES.caller)
    watch.set_discovery(True)
    model.train(train)
    try:
        with torch.set_grad_enabled(grad):
            _validate(model)
    except RuntimeError as exc:
        exc.watch = watch  # type: ignore[attr-defined]
        return exc
    finally:
        watch.remove()
        model.train()
    raise AssertionError("expected the forward to raise")


@pytest.mark.parametrize(("train", "grad", "phase", "words"), [
    (False, False, "eval_forward", "an eval forward of `Net` (model.eval(), gradients off) after 3 optimizer steps"),
    (True, False, "no_grad_forward", "a no-grad forward of `Net` (train mode, gradients off) after 3"),
    (True, True, "training_forward", "the training forward of `Net` after 3 optimizer steps"),
])
def test_where_raised_tells_eval_no_grad_and_training_forwards(train: bool, grad: bool, phase: str,
                                                               words: str) -> None:
    exc = _raise_in_forward(Net(), train=train, grad=grad)
    where = where_raised(exc.__traceback__, FRAMES, exc.watch, step=3)  # type: ignore[attr-defined]
    assert where.phase == phase and where.model == "Net" and words in where.describe()
    assert [link.split(" ")[-1] for link in where.call_chain[-3:]] == [
        "_validate()", "Net.forward()", "Scores.forward()"]


def test_explain_exception_puts_where_and_call_chain_in_message_and_evidence() -> None:
    model = Net()
    exc = _raise_in_forward(model, train=False, grad=False)
    names = {id(m): n for n, m in model.named_modules()}
    finding = explain_exception(exc, FRAMES, names, step=12, models=exc.watch)  # type: ignore[attr-defined]
    assert finding is not None and finding.code == "CAST_OVERFLOW" and finding.module == "scores"
    assert finding.evidence["raised_in"] == "eval_forward"
    assert finding.evidence["where"].startswith("an eval forward of `Net`")
    chain = finding.evidence["call_chain"]
    assert chain[-1].startswith(finding.location) and chain[-1].endswith("Scores.forward()")
    assert f"; where: {finding.evidence['where']}; call chain: {' -> '.join(chain)}" in finding.message


def test_where_raised_without_a_forward_is_the_training_step() -> None:
    try:
        torch.zeros(2, dtype=torch.float16).fill_(1e9)
    except RuntimeError as exc:
        where = where_raised(exc.__traceback__, FRAMES, None, step=0)
    assert where.phase == "training_step" and where.model is None
    assert where.describe() == "training after 0 optimizer steps, outside any forward"
    assert where.call_chain[-1].endswith("test_where_raised_without_a_forward_is_the_training_step()")


def test_where_now_reads_the_live_stack_up_to_the_user_frame() -> None:
    def scaler_call() -> Where:
        return where_now(FRAMES, None, 1)

    where = scaler_call()
    assert where.phase == "training_step" and where.call_chain[-1].endswith("_user_frame.scaler_call()")
    assert "after 1 optimizer step," in where.describe()


def test_where_sentence_keeps_the_last_frames_innermost_last() -> None:
    where = Where("training_step", 2, None, [f"train.py:{i} f{i}()" for i in range(8)])
    evidence = where.evidence()
    assert evidence["call_chain"] == [f"train.py:{i} f{i}()" for i in range(3, 8)]
    assert where_sentence(evidence).endswith("train.py:3 f3() -> train.py:4 f4() -> train.py:5 f5() -> "
                                             "train.py:6 f6() -> train.py:7 f7()")
    assert where_sentence({}) == ""
