"""``ampkit.lint.context``: the questions rules ask about a parsed file."""

from __future__ import annotations

import ast

from ampkit.lint.context import FileContext


def _context(source: str) -> FileContext:
    return FileContext("t.py", source.encode(), ast.parse(source))


def test_context_qualname_resolves_imports_and_a_bare_torch() -> None:
    ctx = _context("import torch.nn.functional as F\nF.softmax\ntorch.load\nnp.load\n")
    names = [ctx.qualname(stmt.value) for stmt in ctx.tree.body[1:]]  # type: ignore[attr-defined]
    assert names == ["torch.nn.functional.softmax", "torch.load", None]


def test_context_autocast_items_include_disabled_regions_withs_do_not() -> None:
    ctx = _context(
        "import torch\n"
        "with torch.autocast('cpu'):\n"
        "    with torch.autocast('cuda', enabled=False):\n"
        "        pass\n"
    )
    module = ctx.scopes[0]
    items = [(info.device, info.dtype, info.enabled) for _, info in ctx.autocast_items(module)]
    assert items == [("cpu", "bf16", True), ("cuda", "fp16", False)]
    assert [info.device for _, info in ctx.autocast_withs(module)] == ["cpu"]


def test_context_optimizer_is_known_by_construction_or_by_name() -> None:
    ctx = _context(
        "import torch\n"
        "a = torch.optim.AdamW(params)\n"
        "b = torch.optim.lr_scheduler.StepLR(a, 1)\n"
        "c = Lion(params)\n"
        "my_opt = make()\n"
    )
    module = ctx.scopes[0]
    calls = list(ctx.bound_calls("a", module)) + list(ctx.bound_calls("b", module))
    assert [ctx.is_optimizer_call(call) for call in calls] == [True, False]
    assert [ctx.is_optimizer(key, module) for key in ("a", "b", "c", "my_opt", None)] == [
        True, False, False, True, False]
    assert ctx.is_scheduler("b", module) and not ctx.is_scheduler("a", module)
