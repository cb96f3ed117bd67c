"""``ampkit.lint.steps``: accumulation boundaries recognised by structure, and training events on paths."""

from __future__ import annotations

import ast

import pytest

from ampkit.lint.context import FileContext
from ampkit.lint.flow import LOOPS
from ampkit.lint.steps import is_boundary_test, step_events, step_paths


def _context(source: str) -> FileContext:
    return FileContext("t.py", source.encode(), ast.parse(source))


def _is_boundary(source: str) -> bool:
    """Whether the ``if`` of the function ``f`` of ``source`` tests an accumulation boundary."""
    ctx = _context(source)
    scope = next(s for s in ctx.scopes if isinstance(s.node, ast.FunctionDef) and s.node.name == "f")
    nodes = list(ast.walk(scope.node))
    test = [n for n in nodes if isinstance(n, ast.If)][-1].test
    return is_boundary_test(ctx, scope, test, [n for n in nodes if isinstance(n, LOOPS)])


@pytest.mark.parametrize("source", [
    "def f(loader, k):\n    for it, b in enumerate(loader):\n        if (it + 1) % k == 0:\n            pass\n",
    "def f(loader, k):\n    for it, b in enumerate(loader):\n        step_now = (it + 1) % k == 0\n"
    "        if step_now:\n            pass\n",
    "def f(loader, k):\n    for it, b in enumerate(loader):\n        if not (it + 1) % k:\n            pass\n",
    "def f(n):\n    for micro_step in range(n):\n        if micro_step == n - 1:\n            pass\n",
    "def f(n):\n    for i in range(n):\n        if i + 1 == n:\n            pass\n",
    "def is_accum_step(i, k):\n    return (i + 1) % k == 0\n"
    "def f(loader, k):\n    for i, b in enumerate(loader):\n        if is_accum_step(i, k):\n            pass\n",
    "def f(loader, accelerator):\n    for b in loader:\n        if accelerator.sync_gradients:\n            pass\n",
], ids=["modulo", "derived-flag", "negated-modulo", "last-micro-step", "counter-plus-one", "helper-function",
        "sync-gradients"])
def test_steps_boundary_is_recognised_by_structure(source: str) -> None:
    assert _is_boundary(source)


@pytest.mark.parametrize("source", [
    "def f(loader, accum):\n    for b in loader:\n        if accum > 1:\n            pass\n",
    "def f(loader, use_amp):\n    for b in loader:\n        if use_amp:\n            pass\n",
    "def f(loader, is_accum_step):\n    for b in loader:\n        if is_accum_step:\n            pass\n",
    "def f(loader, grad_accum_boundary):\n    for b in loader:\n        if grad_accum_boundary():\n            pass\n",
    "def f(loader, total):\n    for i, b in enumerate(loader):\n        if i == 3 - 1:\n            pass\n",
    "def f(loader):\n    for b in loader:\n        if '%d' % b:\n            pass\n",
], ids=["mode-switch", "amp-switch", "name-only-flag", "name-only-call", "constant-bound", "string-format"])
def test_steps_mode_switch_and_names_are_not_boundaries(source: str) -> None:
    assert not _is_boundary(source)


def test_steps_events_follow_a_named_scaled_loss_and_keep_the_structure() -> None:
    ctx = _context(
        "import torch\n"
        "def step(model, opt, scaler, loss):\n"
        "    scaled = scaler.scale(loss)\n"
        "    scaled.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    if opt:\n"
        "        scaler.step(opt)\n"
        "    scaler.update()\n"
    )
    scope = ctx.scopes[1]
    paths = [[(ev.kind, ev.key) for ev in step_events(ctx, scope, path)] for path in step_paths(ctx, scope)]
    assert paths == [
        [("backward", "scaler"), ("clip", None), ("branch", None), ("step", "scaler"), ("update", "scaler"),
         ("end", None)],
        [("backward", "scaler"), ("clip", None), ("branch", None), ("update", "scaler"), ("end", None)],
    ]
