"""``ampkit.lint.flow``: scopes, call sites with their enclosing statements, bindings, imports."""

from __future__ import annotations

import ast

from ampkit.lint.flow import build_flow


def test_flow_call_sites_know_their_loops_and_branches() -> None:
    tree = ast.parse(
        "def train(loader, scaler):\n"
        "    for x in loader:\n"
        "        if x:\n"
        "            scaler.step()\n"
        "    scaler.update()\n"
    )
    flow = build_flow(tree)
    module, function = flow.scopes
    assert module.calls == [] and function.node is tree.body[0]
    step, update = function.calls
    loop = tree.body[0].body[0]  # type: ignore[attr-defined]
    assert step.pos == (4, 12) and update.pos == (5, 4)
    assert step.loops() == [loop] and step.innermost_loop() is loop
    assert step.inside(loop, "body") and not update.inside(loop)
    assert update.innermost_loop() is None


def test_flow_name_bound_twice_keeps_both_values_and_unknowns() -> None:
    tree = ast.parse("import torch as t\nfrom torch.cuda import amp\nx = 1\nx = 2\nfor y in z:\n    pass\n")
    flow = build_flow(tree)
    module = flow.scopes[0]
    assert [ast.literal_eval(v) for v in module.bindings["x"]] == [1, 2]  # type: ignore[arg-type]
    assert module.bindings["y"] == [None]
    assert flow.imports == {"t": "torch", "amp": "torch.cuda.amp"}
