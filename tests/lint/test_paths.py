"""``ampkit.lint.paths``: the paths of a function through its branches, loops and early exits."""

from __future__ import annotations

import ast
import tracemalloc

from ampkit.lint.flow import build_flow
from ampkit.lint.paths import MAX_PATHS, Path, build_paths


def _paths(source: str) -> tuple[list[Path], bool]:
    """The paths of the first function of ``source``, with a CALL event for every call."""
    flow = build_flow(ast.parse(source))
    return build_paths(flow.scopes[1], lambda site: True)


def _trace(path: Path) -> list[str]:
    """A path as readable words: ``call:f``, ``if:7:T`` (``F`` for the else side, ``=`` when
    forced by an earlier test), ``loop:3``, ``iter``, ``exit``, ``jump:return``, ``end``, ``raise``."""
    words = []
    for ev in path:
        if ev.kind == "call":
            words.append(f"call:{ast.unparse(ev.node.func)}")  # type: ignore[attr-defined]
        elif ev.kind == "branch":
            words.append(f"if:{ev.node.lineno}:{'T' if ev.taken else 'F'}{'=' if ev.forced else ''}")  # type: ignore[attr-defined]
        elif ev.kind == "loop":
            words.append(f"loop:{ev.node.lineno}")  # type: ignore[attr-defined]
        elif ev.kind == "jump":
            words.append(f"jump:{type(ev.node).__name__.lower()}")
        else:
            words.append(ev.kind)
    return words


def test_paths_exclusive_branches_are_never_sequenced() -> None:
    paths, complete = _paths(
        "def f(use_amp):\n"
        "    if use_amp:\n"
        "        a()\n"
        "    else:\n"
        "        b()\n"
        "    c()\n"
    )
    assert complete
    assert [_trace(p) for p in paths] == [
        ["if:2:T", "call:a", "call:c", "end"],
        ["if:2:F", "call:b", "call:c", "end"],
    ]


def test_paths_a_retested_condition_follows_the_side_taken() -> None:
    paths, _ = _paths(
        "def f(use_amp):\n"
        "    if use_amp:\n"
        "        a()\n"
        "    if not use_amp:\n"
        "        b()\n"
    )
    assert sorted(_trace(p) for p in paths) == [
        ["if:2:F", "if:4:T=", "call:b", "end"],
        ["if:2:T", "call:a", "if:4:F=", "end"],
    ]


def test_paths_a_loop_runs_one_iteration_and_continue_ends_it() -> None:
    paths, _ = _paths(
        "def f(xs):\n"
        "    for x in xs:\n"
        "        a()\n"
        "        if x:\n"
        "            continue\n"
        "        b()\n"
        "    c()\n"
    )
    assert [_trace(p) for p in paths] == [
        ["loop:2", "call:a", "if:4:F", "call:b", "iter", "exit", "call:c", "end"],
        ["loop:2", "call:a", "if:4:T", "jump:continue", "iter", "exit", "call:c", "end"],
    ]


def test_paths_break_leaves_the_loop_without_ending_the_iteration() -> None:
    paths, _ = _paths(
        "def f(xs):\n"
        "    while True:\n"
        "        if done():\n"
        "            break\n"
        "        a()\n"
    )
    assert sorted(_trace(p) for p in paths) == [
        ["loop:2", "call:done", "if:3:F", "call:a", "iter", "exit", "end"],
        ["loop:2", "call:done", "if:3:T", "jump:break", "exit", "end"],
    ]


def test_paths_return_in_try_runs_the_finally_block_and_raise_ends_the_path() -> None:
    paths, _ = _paths(
        "def f(stop, bad):\n"
        "    try:\n"
        "        a()\n"
        "        if stop:\n"
        "            return\n"
        "        if bad:\n"
        "            raise ValueError\n"
        "    finally:\n"
        "        b()\n"
        "    c()\n"
    )
    assert sorted(_trace(p) for p in paths) == sorted([
        ["call:a", "if:4:F", "if:6:F", "call:b", "call:c", "end"],
        ["call:a", "if:4:T", "jump:return", "call:b", "end"],
        ["call:a", "if:4:F", "if:6:T", "jump:raise", "call:b", "raise"],
    ])


def test_paths_branches_without_wanted_calls_do_not_fork() -> None:
    flow = build_flow(ast.parse(
        "def f(x):\n"
        "    if x:\n"
        "        log()\n"
        "    step()\n"
    ))
    paths, _ = build_paths(flow.scopes[1], lambda site: ast.unparse(site.node.func) == "step")  # type: ignore[attr-defined]
    assert [_trace(p) for p in paths] == [["call:step", "end"]]


def test_paths_past_the_limit_are_dropped_and_marked_incomplete() -> None:
    body = "".join(f"    if c{i}:\n        a{i}()\n" for i in range(12))  # 4096 paths
    paths, complete = _paths("def f():\n" + body)
    assert not complete
    assert 0 < len(paths) <= MAX_PATHS


def test_paths_past_the_limit_keep_both_sides_of_every_later_test() -> None:
    body = "".join(f"    if c{i}:\n        a{i}()\n" for i in range(12))  # 4096 paths
    paths, complete = _paths("def f():\n" + body)
    assert not complete
    for line in (2 + 2 * 11, 2 + 2 * 9):  # the last test, and one met when the limit was reached
        sides = {word for p in paths for word in _trace(p) if word.startswith(f"if:{line}:")}
        assert sides == {f"if:{line}:T", f"if:{line}:F"}


def test_paths_memory_of_a_300_branch_function_is_bounded() -> None:
    # 300 `if c[i]:` blocks, each holding a scaler call: the model holds MAX_PATHS paths of ~600
    # events (about 4 MiB here); it used to copy every decided test into every path at every `if`
    # as well (60 MiB at its peak, O(branches^2) per path).  The bound is generous on purpose.
    calls = ("scaler.scale(loss).backward()", "scaler.step(opt)", "scaler.update()")
    body = "".join(f"    if c[{i}]:\n        {calls[i % 3]}\n" for i in range(300))
    flow = build_flow(ast.parse("def train(scaler, opt, loss, c):\n" + body))
    tracemalloc.start()
    try:
        paths, complete = build_paths(flow.scopes[1], lambda site: True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not complete and len(paths) == MAX_PATHS
    assert all(sum(ev.kind == "branch" for ev in p) == 300 for p in paths)  # every `if` on every path
    assert peak < 32 * 2**20, f"build_paths peaked at {peak / 2**20:.1f} MiB"
