"""The script observers' building blocks: reversible patches, user-code filter, ledger, deferred
reads, checkpoint classification, exception explanations, and the observers on inline code."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkit.diagnose.script.context import Context, Sampler
from ampkit.diagnose.script.errors import explain_exception
from ampkit.diagnose.script.patches import CodeFilter, Ledger, PatchSet, Pending
from ampkit.diagnose.script.rules import finalize
from ampkit.diagnose.script.watchers.io import checkpoint_contents


class _Base:
    def method(self) -> str:
        return "base"


class _Child(_Base):
    pass


def test_doctor_observers_patchset_restores_inherited_and_own_attributes() -> None:
    patches = PatchSet()
    patches.wrap(_Child, "method", lambda orig: lambda self: "wrapped " + orig(self))
    patches.replace(math, "pi", 3.0)
    assert _Child().method() == "wrapped base" and math.pi == 3.0
    patches.restore()
    assert "method" not in vars(_Child), "an inherited attribute must not be left as an own attribute"
    assert _Child().method() == "base" and math.pi == pytest.approx(3.14159, abs=1e-5)
    assert len(patches) == 0


def test_doctor_observers_code_filter_excludes_libraries_under_the_user_folder(tmp_path: Path) -> None:
    venv_file = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "lib.py"
    venv_file.parent.mkdir(parents=True)
    venv_file.write_text("")
    user_file = tmp_path / "train.py"
    user_file.write_text("")
    sys.path.append(str(venv_file.parent))
    try:
        code = CodeFilter([tmp_path])
        assert code.is_user(str(user_file))
        assert not code.is_user(str(venv_file))
        assert not code.is_user(torch.__file__)
        assert not code.is_user("<string>")
    finally:
        sys.path.remove(str(venv_file.parent))


def test_doctor_observers_ledger_keeps_first_and_escalates_severity() -> None:
    led = Ledger()
    assert led.add("LOSS_IN_LOW_PRECISION", key="a", message="first", fix="f", step=3)
    assert not led.add("LOSS_IN_LOW_PRECISION", key="a", message="second", fix="f", step=5, severity="error")
    led.add("LOSS_IN_LOW_PRECISION", key="b", message="other line", fix="f")
    [a, b] = led.findings()
    assert (a.message, a.severity, a.step, a.evidence["occurrences"], a.evidence["steps"]) == (
        "first", "error", 3, 2, [3, 5])
    assert (b.severity, b.evidence["occurrences"]) == ("warning", 1)
    with pytest.raises(ValueError, match="unknown finding code"):
        led.add("NOT_A_CODE", message="m", fix="f")


def test_doctor_observers_pending_delivers_cpu_values_at_once() -> None:
    pending = Pending()
    got: list[float] = []
    pending.read(torch.tensor(2.5), got.append)
    assert got == [2.5] and len(pending) == 0
    pending.flush()
    assert got == [2.5]


def test_doctor_observers_sampler_is_dense_after_an_event() -> None:
    s = Sampler(warmup=1, period=100, after_event=2)
    assert [i for i in range(10) if s.dense(i)] == [0]
    s.boost(5)
    assert [i for i in range(10) if s.dense(i)] == [0, 5, 6, 7]


def test_doctor_observers_checkpoint_contents_recognises_states() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert checkpoint_contents(model.state_dict()) == {"model"}
    assert checkpoint_contents({"m": model.state_dict(), "o": opt.state_dict()}) == {"model", "optimizer"}
    assert checkpoint_contents({"ckpt": {"o": opt.state_dict(), "s": scaler.state_dict()}}) == {"optimizer", "scaler"}
    assert checkpoint_contents([model, opt, scaler]) == {"model", "optimizer", "scaler"}
    assert checkpoint_contents({"step": 3, "lr": 0.1}) == set()


def _raise(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:
        return exc
    raise AssertionError("expected an exception")


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda: torch.zeros(2, dtype=torch.float16).masked_fill(torch.ones(2, dtype=torch.bool), -1e9),
         "CAST_OVERFLOW"),
        (lambda: torch.zeros(2, dtype=torch.bfloat16).fill_(1e39), "CAST_OVERFLOW"),
        (lambda: nn.Linear(4, 4)(torch.ones(2, 4, dtype=torch.float16)), "DTYPE_MISMATCH"),
        (lambda: torch.ones(2, 4, dtype=torch.float16) @ torch.ones(4, 2), "DTYPE_MISMATCH"),
        (lambda: torch.bmm(torch.ones(1, 2, 2, dtype=torch.float16), torch.ones(1, 2, 2)), "DTYPE_MISMATCH"),
        (lambda: nn.Conv1d(2, 2, 1)(torch.ones(1, 2, 3, dtype=torch.bfloat16)), "DTYPE_MISMATCH"),
        (lambda: F.scaled_dot_product_attention(*(torch.ones(1, 2, 4, dtype=d) for d in
                                                   (torch.float16, torch.float32, torch.float32))),
         "DTYPE_MISMATCH"),
        (lambda: nn.LSTM(4, 4)(torch.ones(1, 1, 4, dtype=torch.float16)), "DTYPE_MISMATCH"),
        (lambda: torch.multinomial(torch.tensor([float("nan"), 1.0]), 1), "FORWARD_NAN"),
    ],
)
def test_doctor_observers_explain_real_torch_errors(make: object, code: str) -> None:
    exc = _raise(make)
    finding = explain_exception(exc, CodeFilter([Path(__file__).parent]), {})
    assert finding is not None, str(exc)
    assert finding.code == code and finding.severity == "error"
    assert finding.location is not None and finding.location.startswith(os.path.relpath(__file__))
    assert finding.evidence["exception"].startswith(type(exc).__name__)


def test_doctor_observers_explain_fp16_gradients_and_scaler_order() -> None:
    model = nn.Linear(2, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    code = CodeFilter([Path(__file__).parent])
    finding = explain_exception(_raise(lambda: scaler.step(opt)), code, {})
    assert finding is not None and finding.code == "LOW_PRECISION_PARAMS"
    other = nn.Linear(2, 1)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1)
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.scale(other(torch.ones(1, 2)).sum()).backward()
    scaler2.unscale_(opt2)
    finding = explain_exception(_raise(lambda: scaler2.unscale_(opt2)), code, {})
    assert finding is not None and finding.code == "UNSCALE_ORDER_ERROR"
    assert explain_exception(KeyError("x"), code, {}) is None


def _observe(fn: object) -> Context:
    """Run ``fn`` under the observers (this test file is the user code) and evaluate the end rules."""
    ctx = Context(CodeFilter([Path(__file__).parent]))
    patches = PatchSet()
    ctx.install(patches)
    try:
        fn()  # type: ignore[operator]
    finally:
        patches.restore()
    finalize(ctx, measure_speed=False)
    return ctx


def test_doctor_observers_clip_after_unscale_is_clean_and_before_is_not() -> None:
    def loop(unscale_first: bool) -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    bad = _observe(lambda: loop(False))
    good = _observe(lambda: loop(True))
    assert [f.code for f in bad.ledger.findings()] == ["CLIP_BEFORE_UNSCALE"]
    assert good.ledger.findings() == []
    assert bad.iteration == good.iteration == 2


def test_doctor_observers_count_skips_and_classify_the_cause() -> None:
    def loop() -> None:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(18):
            x = torch.randn(2, 4)
            x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    ctx = _observe(loop)
    assert len(ctx.skips) == 18 and set(ctx.skips.values()) == {"nonfinite_data"}
    collapse = [f for f in ctx.ledger.findings() if f.code == "SCALE_COLLAPSE"]
    assert collapse and collapse[0].evidence["cause"] == "nonfinite_data"
    assert collapse[0].evidence["min_scale"] == 2.0**16 / 2**18
    assert any(f.code == "NONFINITE_INPUT" and f.evidence["samples"] == [0] for f in ctx.ledger.findings())


def test_doctor_observers_resume_without_scaler_state_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    def resume() -> None:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(1, 2)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    [finding] = [f for f in _observe(resume).ledger.findings() if f.code == "CHECKPOINT_MISSING_SCALER"]
    assert "no GradScaler state" in finding.message
    assert finding.location is not None and finding.location.endswith(f":{resume.__code__.co_firstlineno + 1}")


def test_doctor_observers_see_the_deprecated_autocast_classes() -> None:
    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(FutureWarning):
            region = torch.cpu.amp.autocast(dtype=torch.bfloat16)
        with region:
            for _ in range(2):   # the optimizer steps inside the region: stale cached weights
                model(torch.randn(3, 4)).float().sum().backward()
                opt.step()
                opt.zero_grad()

    ctx = _observe(loop)
    assert ctx.forwards.autocast[torch.bfloat16] == 2
    assert [f.code for f in ctx.ledger.findings()] == ["STALE_WEIGHT_CACHE"]
