"""UserFrames: the one user-frame classifier."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ampkit._util.frames import UserFrames


def test_doctor_observers_code_filter_excludes_libraries_under_the_user_folder(tmp_path: Path) -> None:
    venv_file = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "lib.py"
    venv_file.parent.mkdir(parents=True)
    venv_file.write_text("")
    user_file = tmp_path / "train.py"
    user_file.write_text("")
    sys.path.append(str(venv_file.parent))
    try:
        code = UserFrames([tmp_path])
        assert code.is_user(str(user_file))
        assert not code.is_user(str(venv_file))
        assert not code.is_user(torch.__file__)
        assert not code.is_user("<string>")
    finally:
        sys.path.remove(str(venv_file.parent))


def test_user_frames_call_chain_lists_user_frames_outermost_first(tmp_path: Path) -> None:
    frames = UserFrames([tmp_path])
    source = "class Trainer:\n    def step(self):\n        return inner()\n\ndef inner():\n    raise KeyError('x')\n"
    namespace: dict[str, object] = {}
    exec(compile(source, str(tmp_path / "train.py"), "exec"), namespace)
    try:
        namespace["Trainer"]().step()  # type: ignore[operator]
    except KeyError as exc:
        chain = frames.call_chain(exc.__traceback__)
    shown = [link.split(" ", 1)[1] for link in chain]
    assert shown == ["Trainer.step()", "inner()"]  # this test file is not under tmp_path: left out
    assert chain[-1].endswith("train.py:6 inner()")


def test_user_frames_caller_frame_stops_at_the_stop_frame() -> None:
    frames = UserFrames([Path(__file__).parent])
    outer = sys._getframe()

    def library_side(stop: object) -> object:  # walks from its caller, the library frame run()
        return frames.caller_frame(2, stop=stop)  # type: ignore[arg-type]

    ns: dict[str, object] = {"library_side": library_side}
    exec(compile("def run(stop): return library_side(stop)", "/usr/lib/python3/not_user.py", "exec"), ns)
    # this test's frame is a user frame, but it is the stop frame: no user frame above it runs the code
    assert ns["run"](outer) is None  # type: ignore[operator]
    assert ns["run"](None) is outer  # type: ignore[operator]
