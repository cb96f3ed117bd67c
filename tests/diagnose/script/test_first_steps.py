"""``capture_first_steps``: a training script run as ``__main__`` until its first optimizer steps, their root
forwards captured for replay, the script stopped and everything it ran under put back."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampkit.diagnose.replay import replay
from ampkit.diagnose.script.first_steps import capture_first_steps
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.precision import Precision

from .test_runner import _torch_surface


def _write(path: Path, *parts: str) -> Path:
    """Write the script made of ``parts``, each dedented on its own."""
    path.write_text("".join(textwrap.dedent(part) for part in parts))
    return path


HEAD = """
    import sys
    from pathlib import Path
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

PLAIN = HEAD + """
    for step in range(20):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    Path(sys.argv[1]).write_text("the loop ended")
"""


def test_capture_first_steps_stops_a_plain_script_after_two_steps_with_replayable_captures(tmp_path: Path) -> None:
    done = tmp_path / "done.txt"
    first = capture_first_steps(_write(tmp_path / "train.py", PLAIN), [str(done)])
    assert (first.ended, first.steps, first.error, first.missing) == ("steps", 2, None, None)
    assert [cap.step for cap in first.captures] == [1, 2]
    assert not done.exists()
    assert first.location == f"{tmp_path / 'train.py'}:12"
    for cap in first.captures:
        assert cap.autocast == ("cpu", torch.bfloat16, False)
        result = replay(cap, Precision.parse("bf16"))
        assert isinstance(result, DiagnosisResult)
        assert result.comparison


def test_capture_first_steps_stops_a_loop_that_catches_exception_around_the_step(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        for step in range(20):
            try:
                loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            except Exception:
                continue
        Path(sys.argv[1]).write_text("the loop ended")
    """)
    done = tmp_path / "done.txt"
    first = capture_first_steps(script, [str(done)])
    assert (first.ended, first.steps, len(first.captures)) == ("steps", 2, 2)
    assert not done.exists()


def test_capture_first_steps_keeps_every_micro_batch_of_an_accumulated_step(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        for step in range(10):
            for micro in range(2):
                loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)) / 2
                loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    first = capture_first_steps(script)
    assert first.steps == 2
    assert [cap.step for cap in first.captures] == [1, 1, 2, 2]
    assert all(cap.grads and cap.grads[0] is not None for cap in first.captures)
    assert first.captures[0].args[0] is not first.captures[1].args[0]


def test_capture_first_steps_reports_a_script_that_ends_after_one_step_as_exit(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        opt.step()
    """)
    first = capture_first_steps(script)
    assert (first.ended, first.steps, len(first.captures), first.error) == ("exit", 1, 1, None)


def test_capture_first_steps_reports_a_script_that_raises_before_stepping(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        raise ValueError("no batches in the data folder")
    """)
    first = capture_first_steps(script)
    assert (first.ended, first.steps, first.captures) == ("exception", 0, [])
    assert first.error == "ValueError: no batches in the data folder"
    assert first.missing is not None and "optimizer step" in first.missing


@pytest.mark.parametrize(("body", "missing"), [
    ("print('no training here')", "a call of a model"),
    ("model(torch.randn(4, 8)).sum().backward()", "an optimizer step"),
])
def test_capture_first_steps_names_what_a_script_never_did(tmp_path: Path, body: str, missing: str) -> None:
    first = capture_first_steps(_write(tmp_path / "train.py", HEAD, body))
    assert (first.ended, first.captures) == ("exit", [])
    assert first.missing is not None and first.missing.startswith(missing)


def test_capture_first_steps_records_the_scripts_autocast_and_loss_scale(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for step in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """)
    first = capture_first_steps(script, steps=1)
    (cap,) = first.captures
    assert cap.autocast == ("cpu", torch.float16, True)
    assert cap.scale is not None and float(cap.scale) == 256.0


def test_capture_first_steps_keeps_no_autograd_graph_of_the_script(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", HEAD, """
        head = nn.Linear(1, 1)
        opt.add_param_group({"params": head.parameters()})
        for step in range(5):
            loss = head(model(torch.randn(4, 8))).pow(2).mean()   # head's input: model's output
            loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    first = capture_first_steps(script)
    assert len(first.captures) == 4  # model and head, each step
    for cap in first.captures:
        assert cap.grad_fns == []
        tensors = [*cap.args, *cap.outputs, *(g for g in cap.grads if g is not None)]
        assert all(t.grad_fn is None for t in tensors)
    head_input = next(cap.args[0] for cap in first.captures if isinstance(cap.root, torch.nn.Linear))
    assert head_input.requires_grad  # as it was in the script: a leaf now


def test_capture_first_steps_puts_back_everything_the_run_changed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    script = _write(tmp_path / "train.py", """
        import os, signal, sys
        sys.path.append("/nowhere/the/script/added")
        os.chdir(os.path.join(os.path.dirname(__file__), "elsewhere"))
        signal.signal(signal.SIGUSR1, lambda *_: None)
    """, PLAIN)
    argv, path, cwd, usr1 = sys.argv[:], sys.path[:], os.getcwd(), signal.getsignal(signal.SIGUSR1)
    surface = _torch_surface()
    first = capture_first_steps(script, [str(tmp_path / "done.txt")])
    assert first.ended == "steps"
    assert (sys.argv, sys.path, os.getcwd(), signal.getsignal(signal.SIGUSR1)) == (argv, path, cwd, usr1)
    assert sys.modules["__main__"].__name__ == "__main__" and not hasattr(sys.modules["__main__"], "opt")
    assert _torch_surface() == surface
    model = first.captures[0].root
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_capture_first_steps_runs_a_module_as_python_m_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "first_steps_trainmod.py", PLAIN)
    first = capture_first_steps("first_steps_trainmod", [str(tmp_path / "done.txt")], module=True, steps=1)
    assert (first.ended, len(first.captures)) == ("steps", 1)
    assert first.location == "first_steps_trainmod.py:12"  # found on sys.path[0], the working directory


def test_capture_first_steps_refuses_fewer_than_one_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps must be at least 1"):
        capture_first_steps(_write(tmp_path / "train.py", PLAIN), steps=0)
