"""The watcher contract: the Context builds each watcher once, on the run state; @override on every override."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import torch
from typing_extensions import override

import ampkit.diagnose.script as script_package
from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from ampkit.diagnose.script.watchers.base import Watcher, dispatch_backward
from diagnose.script.watchers.alone import run_state

SCRIPT = Path(script_package.__file__).parent
WATCHER_METHODS = [name for name, _ in inspect.getmembers(Watcher, inspect.isfunction) if not name.startswith("_")]


def _built() -> list[type[Watcher]]:
    return [type(w) for w in Context(UserFrames([Path(__file__).parent])).watchers]


def test_context_builds_every_watcher_once() -> None:
    defined = {cls for cls in _subclasses(Watcher)  # the module-level classes of src/, not those of tests
               if cls.__module__.startswith("ampkit.") and getattr(sys.modules[cls.__module__], cls.__name__, None) is cls}
    built = _built()
    assert len(built) == len(set(built)) and set(built) == defined, "build each in Context.__init__'s list"


def test_watchers_mark_every_override() -> None:
    assert WATCHER_METHODS == ["after_backward", "before_backward", "finish", "install", "on_root_forward"]
    missing = [f"{cls.__qualname__}.{name}" for cls in _built() for name in WATCHER_METHODS
               if name in vars(cls) and not getattr(vars(cls)[name], "__override__", False)]
    assert missing == [], f"put @override (typing_extensions) on: {missing}"


def test_watcher_modules_import_no_other_watcher() -> None:
    """What two watchers share is a field of the run state: a watcher module imports ``watchers.base`` at most;
    services, the state, the failures and the models service import no watcher."""
    offenders = []
    below = [*(SCRIPT / "services").glob("*.py"), SCRIPT / "state.py", SCRIPT / "failures.py", SCRIPT / "models.py"]
    for path in [*(SCRIPT / "watchers").glob("*.py"), *below]:
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("ampkit.diagnose.script.watchers") and (
                    module != "ampkit.diagnose.script.watchers.base" or path in below):
                offenders.append(f"{path.relative_to(SCRIPT)} imports {module}")
    assert offenders == []


def test_context_calls_only_overrides_on_forward() -> None:
    ctx = Context(UserFrames([Path(__file__).parent]))
    assert [type(w) for w in ctx._forward_watchers] == [AutocastWatch]
    assert ctx.autocast in ctx.watchers and all(w.state is ctx.state for w in ctx.watchers)


def _subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def test_watchers_share_one_backward_wrapper_that_calls_them_in_order() -> None:
    """Backward is an event of the contract: no watcher wraps ``torch.autograd.backward`` itself, and
    ``dispatch_backward`` calls each listener before and after, in registry order, never while paused."""
    for path in (SCRIPT / "watchers").glob("*.py"):
        wraps = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr == "wrap" and len(node.args) > 1
                 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "backward"]
        assert len(wraps) == (path.name == "base.py"), f"{path.name} wraps backward itself: override before_backward"
    calls: list[tuple[str, int]] = []

    class First(Watcher):
        @override
        def before_backward(self, tensors: list[torch.Tensor]) -> None:
            calls.append(("first.before", len(tensors)))

        @override
        def after_backward(self, tensors: list[torch.Tensor]) -> None:
            calls.append(("first.after", len(tensors)))

    class Second(Watcher):
        @override
        def before_backward(self, tensors: list[torch.Tensor]) -> None:
            calls.append(("second.before", len(tensors)))

    state = run_state()
    patches = PatchSet()
    original = torch.autograd.backward
    dispatch_backward([First(state), Watcher(state), Second(state)], state, patches)
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        torch.autograd.backward([(x * 3).sum(), (x * 5).sum()])
        state.models.paused = True
        (x * 4).sum().backward()
    finally:
        state.models.paused = False
        patches.restore()
    assert torch.autograd.backward is original
    assert calls == [("first.before", 1), ("second.before", 1), ("first.after", 1),
                     ("first.before", 2), ("second.before", 2), ("first.after", 2)]
