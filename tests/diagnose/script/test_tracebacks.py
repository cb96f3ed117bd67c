"""The traceback printed for a script's unexplained exception leaves out the doctor's pass-through wrappers."""

from __future__ import annotations

import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.runner import run_script
from ampkit.diagnose.script.tracebacks import user_traceback


def _library_call(x: int) -> int:
    if x < 0:
        raise ValueError("negative")
    return x


def _frame_names(exc: BaseException, patches: PatchSet) -> list[str]:
    tb = user_traceback(exc, UserFrames(), patches.wrapped)
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def _patched(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> tuple[types.ModuleType, PatchSet]:
    lib = types.ModuleType("lib")
    lib.call = _library_call  # type: ignore[attr-defined]
    patches = PatchSet()
    patches.wrap(lib, "call", make)
    return lib, patches


def _raised(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except ValueError as exc:
        return exc
    raise AssertionError("expected a ValueError")


def test_a_wrapper_that_passed_the_call_on_is_left_out() -> None:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def pass_on(x: int) -> int:
            return orig(x)
        return pass_on

    lib, patches = _patched(make)
    exc = _raised(lambda: lib.call(-1))
    assert _frame_names(exc, patches) == ["_raised", "<lambda>", "_library_call"]


def test_a_wrapper_called_through_user_frames_call_is_left_out_with_the_helper() -> None:
    frames = UserFrames()

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def relay(x: int) -> int:
            return frames.call(orig, x)
        return relay

    lib, patches = _patched(make)
    exc = _raised(lambda: lib.call(-1))
    assert _frame_names(exc, patches) == ["_raised", "<lambda>", "_library_call"]


def test_a_wrapper_whose_own_code_raised_stays() -> None:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def checks_after(x: int) -> int:
            out = orig(abs(x))
            if out > 0:
                raise ValueError("the wrapper's own check")
            return out
        return checks_after

    lib, patches = _patched(make)
    exc = _raised(lambda: lib.call(-1))
    assert _frame_names(exc, patches) == ["_raised", "<lambda>", "checks_after"]


@pytest.mark.parametrize(("body", "library_file"), [
    ("torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type='bad')", "clip_grad.py"),
    ("torch.optim.SGD([], lr=0.1)", "optimizer.py"),
])
def test_the_scripts_traceback_goes_from_its_line_into_torch_without_ampkit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, library_file: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        model = torch.nn.Linear(4, 4)
        model(torch.randn(2, 4)).sum().backward()
        {body}
    """))
    report = run_script(script, checkup=False, measure_speed=False)
    err = capsys.readouterr().err
    assert report.exit_status == 1
    assert f'File "{script}", line 5, in <module>' in err
    assert library_file in err
    assert "ampkit" not in err.split("Traceback (most recent call last):")[1].split("\n\n")[0]


def test_an_explained_exception_still_prints_the_scripts_traceback_before_the_explanation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An fp16 batch meets the fp32 model outside autocast: DTYPE_MISMATCH explains it, and the user
    # still sees where their script raised.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch

        def forward(model, x):
            return model(x)

        model = torch.nn.Linear(4, 4)
        forward(model, torch.randn(2, 4).half())
    """))
    report = run_script(script, checkup=False, measure_speed=False)
    err = capsys.readouterr().err
    assert report.exit_status == 1 and "DTYPE_MISMATCH" in [f.code for f in report.findings]
    trace = err.index("Traceback (most recent call last):")
    assert err.index(f'File "{script}", line 8, in <module>') > trace
    assert err.index(f'File "{script}", line 5, in forward') > trace
    assert err.index("(explained below)") > err.index("RuntimeError: ", trace)
