"""GradScaler's step-order assertions: every message of the installed torch, raised for real,
becomes UNSCALE_ORDER_ERROR with the user's line and the corrected order."""

from __future__ import annotations

import ast
import copy
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.errors import explain_exception
from ampkit.diagnose.script.order import ORDER_RULES, OrderContext, explain_order


def _setup() -> tuple[nn.Linear, torch.optim.SGD, torch.amp.GradScaler]:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.amp.GradScaler("cpu")


def _backward(model: nn.Module, scaler: torch.amp.GradScaler) -> None:
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()


def _update_first() -> None:
    model, _, scaler = _setup()
    _backward(model, scaler)
    scaler.update()


def _unscale_twice() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def _unscale_after_step() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.step(opt)
    scaler.unscale_(opt)


def _step_twice() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.step(opt)
    scaler.step(opt)


def _step_without_grads() -> None:
    model, _, scaler = _setup()
    frozen = nn.Linear(3, 1)
    _backward(model, scaler)
    scaler.step(torch.optim.SGD(frozen.parameters(), lr=0.1))


def _step_unused_scaler() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    torch.amp.GradScaler("cpu").step(opt)


def _copy_mid_iteration() -> None:
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.step(opt)
    copy.deepcopy(scaler)


def _raised(fn: Callable[[], None]) -> BaseException:
    try:
        fn()
    except (RuntimeError, AssertionError) as exc:
        return exc
    raise AssertionError("expected GradScaler to raise")


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (_update_first, "No inf checks were recorded prior to update"),
        (_unscale_twice, "unscale_() has already been called on this optimizer"),
        (_unscale_after_step, "unscale_() is being called after step()"),
        (_step_twice, "step() has already been called since the last update()"),
        (_step_without_grads, "No inf checks were recorded for this optimizer"),
        (_step_unused_scaler, "_scale is None"),
        (_copy_mid_iteration, "may only be pickled at the beginning of an iteration"),
    ],
)
def test_explain_exception_files_each_scaler_assertion_as_order_error_with_line_and_corrected_order(
        fn: Callable[[], None], needle: str) -> None:
    exc = _raised(fn)
    finding = explain_exception(exc, UserFrames([Path(__file__).parent]), {}, step=8)  # the 8th, after 7
    assert finding is not None and finding.code == "UNSCALE_ORDER_ERROR", str(exc)
    assert finding.evidence["assertion"] == needle
    rule = explain_order(str(exc))
    assert rule is not None and finding.evidence["corrected_order"] == rule.corrected
    assert rule.corrected in finding.fix and rule.violated in finding.message
    assert finding.location is not None and finding.location.startswith(os.path.relpath(__file__))
    # the user's line is the scaler call inside the helper, and the call chain ends there
    assert finding.evidence["call_chain"][-1].startswith(finding.location + " ")
    assert finding.evidence["raised_in"] == "training_step" and "after 7 optimizer steps" in finding.message


_NOT_ORDER = (
    "growth factor must be", "backoff factor must be", "_growth_tracker initialized before _scale",
    "should not be None after lazy init", "_get_scale_async returned None", "new_scale should be a float",
    "Closure use is not currently supported", "The source state dict is empty", "outputs must be a Tensor",
    "expected param to be torch.Tensor", "Attempting to unscale FP16 gradients",
)
"""GradScaler's other messages: argument checks, internal invariants, closures, empty state dicts, and
fp16 parameters (LOW_PRECISION_PARAMS)."""


def _raised_messages(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            # f-strings and "..." + fix: the literal parts, in order
            text = "".join(p.value for p in ast.walk(node.exc.args[0])
                           if isinstance(p, ast.Constant) and isinstance(p.value, str))
            if text:
                out.append(text)
    return out


def test_order_rules_cover_every_order_assertion_of_installed_torch() -> None:
    messages = _raised_messages(ast.parse(Path(torch.amp.grad_scaler.__file__).read_text()))
    assert len(messages) > 10
    unexplained = [m for m in messages if explain_order(m) is None]
    assert all(any(n in m for n in _NOT_ORDER) for m in unexplained), unexplained
    for rule in ORDER_RULES:
        assert any(rule.needle in m for m in messages), f"{rule.needle!r} is no longer raised by GradScaler"


def test_explain_order_picks_the_variant_from_the_scaler_state() -> None:
    prior = "No inf checks were recorded prior to update."
    accumulation = explain_order(prior, OrderContext("update", backwards=1, stepped=False))
    twice = explain_order(prior, OrderContext("update", backwards=0))
    assert accumulation is not None and accumulation.variant == "accumulation"
    assert "if (i + 1) % accum_steps == 0:\n" in accumulation.corrected
    assert twice is not None and twice.variant == "default"
    stepped = "step() has already been called since the last update()."
    missing = explain_order(stepped, OrderContext("step", backwards=1, optimizers=1))
    looped = explain_order(stepped, OrderContext("step", backwards=1, optimizers=2))
    assert missing is not None and missing.variant == "missing_update"
    assert looped is not None and looped.variant == "default" and "optimizer_g" in looped.corrected
    other = explain_order("Attempted step but _scale is None.", OrderContext("step", other_scaler_scaled=True))
    assert other is not None and other.variant == "other_scaler"
    assert explain_order("Attempted step but _scale is None.") is not None


def test_explain_order_corrected_orders_are_valid_python() -> None:
    for rule in ORDER_RULES:
        compile(rule.corrected, rule.needle, "exec")
