"""The watcher contract: one registry, services by constructor parameter, @override on every override."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

import pytest
import torch
from typing_extensions import override

import ampkit.diagnose.script as script_package
from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services import Services
from ampkit.diagnose.script.watchers import WATCHERS, Watcher
from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from ampkit.diagnose.script.watchers.base import dispatch_backward
from diagnose.script.watchers.alone import services

SCRIPT = Path(script_package.__file__).parent
WATCHER_METHODS = [name for name, _ in inspect.getmembers(Watcher, inspect.isfunction) if not name.startswith("_")]


def test_watchers_registry_holds_every_watcher_once() -> None:
    defined = {cls for cls in _subclasses(Watcher)  # the module-level classes of src/, not those of tests
               if cls.__module__.startswith("ampkit.") and getattr(sys.modules[cls.__module__], cls.__name__, None) is cls}
    assert len(WATCHERS) == len(set(WATCHERS)) and set(WATCHERS) == defined, "register each in watchers.WATCHERS"


def test_watchers_mark_every_override() -> None:
    assert WATCHER_METHODS == ["after_backward", "before_backward", "finish", "install", "on_root_forward"]
    missing = [f"{cls.__qualname__}.{name}" for cls in WATCHERS for name in WATCHER_METHODS
               if name in vars(cls) and not getattr(vars(cls)[name], "__override__", False)]
    assert missing == [], f"put @override (typing_extensions) on: {missing}"


@pytest.mark.parametrize("cls", WATCHERS, ids=lambda c: c.__name__)
def test_watchers_ask_for_services_by_name_and_type(cls: type[Watcher]) -> None:
    fields = typing.get_type_hints(Services)
    asked = {name: hint for name, hint in typing.get_type_hints(cls.__init__).items() if name != "return"}
    assert asked and {name: fields.get(name) for name in asked} == asked
    built, _ = services()
    assert isinstance(cls(**built.arguments(cls)), cls)


def test_watcher_modules_import_no_other_watcher() -> None:
    """What two watchers share is a service: a watcher module imports ``watchers.base`` at most; services,
    the state and the models service import no watcher."""
    offenders = []
    below = [*(SCRIPT / "services").glob("*.py"), SCRIPT / "state.py", SCRIPT / "models.py"]
    for path in [*(SCRIPT / "watchers").glob("*.py"), *below]:
        if path.name == "__init__.py" and path.parent.name == "watchers":
            continue  # the registry
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("ampkit.diagnose.script.watchers") and (
                    module != "ampkit.diagnose.script.watchers.base" or path in below):
                offenders.append(f"{path.relative_to(SCRIPT)} imports {module}")
    assert offenders == []


def test_services_refuse_a_constructor_parameter_that_is_no_service() -> None:
    class NeedsAWatcher(Watcher):
        def __init__(self, state: object, *, autocast: AutocastWatch) -> None:
            self.autocast = autocast

    built, _ = services()
    with pytest.raises(TypeError, match=r"NeedsAWatcher\(\) asks for autocast, which is no service.*by these names: "
                                        r"casts, frameworks, optimizers, regions, scalers, state"):
        built.arguments(NeedsAWatcher)
    assert [f.name for f in dataclasses.fields(Services)] == ["state", "optimizers", "scalers", "regions", "casts",
                                                                "frameworks"]


def test_context_builds_one_watcher_of_each_and_calls_only_overrides_on_forward() -> None:
    ctx = Context(UserFrames([Path(__file__).parent]))
    assert [type(w) for w in ctx.watchers] == list(WATCHERS)
    assert ctx.autocast is ctx.watcher(AutocastWatch) and ctx.scalers is ctx.services.scalers
    assert [type(w) for w in ctx._forward_watchers] == [AutocastWatch]

    class Unregistered(Watcher):
        @override
        def finish(self) -> None: ...

    with pytest.raises(LookupError, match="register it in watchers.WATCHERS"):
        ctx.watcher(Unregistered)


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

    built, _ = services()
    patches = PatchSet()
    original = torch.autograd.backward
    dispatch_backward([First(), Watcher(), Second()], built.state, patches)
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        torch.autograd.backward([(x * 3).sum(), (x * 5).sum()])
        built.state.models.paused = True
        (x * 4).sum().backward()
    finally:
        built.state.models.paused = False
        patches.restore()
    assert torch.autograd.backward is original
    assert calls == [("first.before", 1), ("second.before", 1), ("first.after", 1),
                     ("first.before", 2), ("second.before", 2), ("first.after", 2)]
