"""The path model of one function body: every way through its branches, loops and early exits,
as a sequence of events.

A *path* is what one execution of the function could do, restricted to the statements that
matter (the calls a rule asked about, and the jumps ``continue`` / ``break`` / ``return`` /
``raise``).  The model is small on purpose:

- ``if``/``else`` (and ``match``) fork the path; the two sides of one ``if`` are never in the same
  path, so exclusive branches are never sequenced.  A test met again on the same path (``if
  use_amp:`` ... ``if use_amp:``, or ``if not use_amp:``) follows the side already taken: the two
  branches are correlated, not independent.
- a loop runs its body once, between a ``LOOP`` and an ``ITER`` event (the end of an iteration,
  reached by falling through or by ``continue``), then ``EXIT``s (by its condition or ``break``).
  One iteration is enough for the rules here: they ask what one micro-batch or one optimizer step
  does, and a loop-carried mistake shows up as a state still open at ``ITER``.
- ``return`` ends the path with ``END`` (after the ``finally`` blocks around it), as does falling
  off the end; ``raise`` ends it with ``RAISE``.  An exception handler is a path that skips its
  ``try`` body (the exception came first); handlers holding nothing of interest are not followed.
- statements and ``if``s that hold nothing of interest are skipped without forking, so the number
  of paths grows only with the branches that matter.  Past ``MAX_PATHS`` paths are dropped,
  evenly over the paths so far and keeping at least half the room for each side of an ``if``
  that needs it, so both sides of every test stay on some kept path: every path kept is still a
  real path, so a rule that reports what happens on *some* path stays precise and only loses
  recall on such functions.  Cost: O(MAX_PATHS x events) per function, linear in its length.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ampkit.lint.astutil import expr_key
from ampkit.lint.flow import LOOPS, Scope, Site

__all__ = ["BRANCH", "CALL", "END", "EXIT", "ITER", "JUMP", "LOOP", "MAX_PATHS", "RAISE", "Event", "Path",
           "build_paths", "implied", "test_key"]

CALL, BRANCH, LOOP, ITER, EXIT, JUMP, END, RAISE = "call", "branch", "loop", "iter", "exit", "jump", "end", "raise"
MAX_PATHS = 512
"""Paths kept per function; a training step has a handful of relevant branches (2^9 paths)."""

_TRY = (ast.Try, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))
_OUTCOMES = ("next", "continue", "break", "return", "raise")


@dataclass(frozen=True, slots=True)
class Event:
    """One step of a path.  ``node``: the call's site node, the ``if``, the loop or the jump."""

    kind: str
    node: ast.AST
    site: Site | None = None
    """For ``CALL``: where the call sits (its loops and branches)."""
    taken: bool = True
    """For ``BRANCH``: the side taken (True: the body, False: the ``else``)."""
    forced: bool = False
    """For ``BRANCH``: the test was already decided earlier on this path (a correlated ``if``)."""


Path = tuple[Event, ...]

# A path under construction: a linked list of events (shared prefixes, O(1) append) and the tests
# decided so far that another ``if`` of the function tests again, test key -> outcome.  Only those
# are kept: a fact nobody asks about again would cost a copy per state and ``if`` for nothing
# (with every fact kept, a function of n ``if``s cost O(n^2) per path).  The mapping is shared
# between states and copied only when a re-tested fact is added.
_Chain = tuple[Event, "_Chain"] | None
_Facts = dict[str, bool]
_State = tuple[_Chain, _Facts]
_Outcomes = dict[str, list[_State]]
_NO_FACTS: _Facts = {}


def test_key(test: ast.expr) -> tuple[str, bool]:
    """``(identity, polarity)`` of an ``if`` test: ``not x`` is ``x`` with the opposite polarity.

    >>> test_key(ast.parse("not self.use_amp", mode="eval").body)
    ('self.use_amp', False)
    """
    polarity = True
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, polarity = test.operand, not polarity
    return expr_key(test) or ast.dump(test), polarity


def implied(test: ast.expr, outcome: bool) -> tuple[tuple[str, bool], ...]:
    """The tests decided by ``test`` having evaluated to ``outcome``, as ``(key, value)`` pairs.

    A true ``a and not b`` decides ``a`` and ``b`` as well (and a false ``a or b`` both operands), so a
    later ``if not b:`` on the same path takes the side it must (Lightning's
    ``if ... and not skip: unscale_()`` ... ``if not skip: step(); update()``).

    >>> both = ast.parse("ready and not skip", mode="eval").body
    >>> implied(both, True)[1:]
    (('ready', True), ('skip', False))
    >>> len(implied(both, False))  # the test itself only: either operand may have been false
    1
    """
    key, polarity = test_key(test)
    facts: tuple[tuple[str, bool], ...] = ((key, outcome == polarity),)
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, outcome = test.operand, not outcome
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And if outcome else ast.Or):
        for value in test.values:
            facts += implied(value, outcome)
    return facts


def build_paths(scope: Scope, wanted: Callable[[Site], bool]) -> tuple[list[Path], bool]:
    """Every path through the body of ``scope`` (a function), with a ``CALL`` event for each call
    ``wanted`` selects; and whether the list is complete (False when cut at ``MAX_PATHS``)."""
    walker = _Paths(scope, wanted)
    node = scope.node
    body = node.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)) else []
    out = walker.block(body, [(None, _NO_FACTS)])
    paths = [_unwind(_push(s, Event(END, node))) for s in (*out["next"], *out["return"])]
    paths += [_unwind(_push(s, Event(RAISE, node))) for s in out["raise"]]
    return paths, walker.complete


def _push(state: _State, event: Event) -> _State:
    return (event, state[0]), state[1]


def _unwind(state: _State) -> Path:
    events: list[Event] = []
    chain = state[0]
    while chain is not None:
        events.append(chain[0])
        chain = chain[1]
    return tuple(reversed(events))


def _spread(states: list[_State], keep: int) -> list[_State]:
    """``keep`` of ``states`` at even intervals (in order): the sample keeps the mix of earlier
    decisions that the list has."""
    total = len(states)
    if total <= keep:
        return states
    return [states[i * total // keep] for i in range(keep)]


def _empty() -> _Outcomes:
    return {name: [] for name in _OUTCOMES}


class _Paths:
    __slots__ = ("calls", "complete", "relevant", "retested", "tests")

    def __init__(self, scope: Scope, wanted: Callable[[Site], bool]) -> None:
        self.calls: dict[int, list[Site]] = {}
        self.relevant: set[int] = set()
        self.complete = True
        self.tests: dict[int, tuple[str, bool, _Facts, _Facts]] = {}
        """``id(if)`` -> its test key, polarity, and the re-tested facts each outcome decides."""
        ifs: dict[int, ast.If] = {}
        marked: Iterable[Site] = scope.jumps
        for site in scope.calls:
            if wanted(site):
                self.calls.setdefault(id(site.stmt), []).append(site)
                self.relevant.add(id(site.stmt))
                self.relevant.update(id(f[0]) for f in site.frames)
                ifs.update((id(f[0]), f[0]) for f in site.frames if isinstance(f[0], ast.If))  # type: ignore[misc]
        for site in marked:
            self.relevant.add(id(site.stmt))
            self.relevant.update(id(f[0]) for f in site.frames)
            ifs.update((id(f[0]), f[0]) for f in site.frames if isinstance(f[0], ast.If))  # type: ignore[misc]
        self.retested: Counter[str] = Counter(test_key(stmt.test)[0] for stmt in ifs.values())
        """How many of the ``if``s that fork test each key (a fact is kept only when another one asks)."""
        for sites in self.calls.values():
            # Evaluation order: a call completes after the calls inside it (scale() before backward()).
            sites.sort(key=lambda s: (getattr(s.node, "end_lineno", 0), getattr(s.node, "end_col_offset", 0)))

    def cap(self, states: list[_State]) -> list[_State]:
        if len(states) > MAX_PATHS:
            self.complete = False
            return _spread(states, MAX_PATHS)
        return states

    def fair(self, first: list[_State], second: list[_State]) -> list[_State]:
        """``first + second`` cut at ``MAX_PATHS`` (see ``split``)."""
        a, b = self.split(first, second)
        return a + b

    def split(self, first: list[_State], second: list[_State]) -> tuple[list[_State], list[_State]]:
        """``first`` and ``second`` cut to ``MAX_PATHS`` together, each side keeping at least half
        the room when it needs it, and each cut spread evenly over its list: past the limit both
        sides of every ``if`` keep paths (cutting a prefix would follow only the ``if`` side of
        every later test, and drop the ``else`` side of the earlier ones at the next test)."""
        if len(first) + len(second) <= MAX_PATHS:
            return first, second
        self.complete = False
        keep = min(len(first), max(MAX_PATHS // 2, MAX_PATHS - len(second)))
        return _spread(first, keep), _spread(second, MAX_PATHS - keep)

    def test(self, stmt: ast.If) -> tuple[str, bool, _Facts, _Facts]:
        """The test key of ``stmt``, its polarity and what each outcome decides (computed once)."""
        found = self.tests.get(id(stmt))
        if found is None:
            key, polarity = test_key(stmt.test)
            sides = []
            for outcome in (True, False):
                facts = {k: v for k, v in implied(stmt.test, outcome)
                         if self.retested[k] > (1 if k == key else 0)}
                sides.append(facts)
            found = self.tests[id(stmt)] = (key, polarity, sides[0], sides[1])
        return found

    def header(self, stmt: ast.AST, states: list[_State]) -> list[_State]:
        for site in self.calls.get(id(stmt), ()):
            event = Event(CALL, site.node, site)
            states = [_push(s, event) for s in states]
        return states

    def block(self, stmts: list[ast.stmt], states: list[_State]) -> _Outcomes:
        done = _empty()
        for stmt in stmts:
            if not states:
                break
            if id(stmt) not in self.relevant:
                continue
            out = self.stmt(stmt, states)
            states = out.pop("next")
            for name, more in out.items():
                done[name].extend(more)
        done["next"] = states
        return done

    def stmt(self, stmt: ast.stmt, states: list[_State]) -> _Outcomes:
        states = self.header(stmt, states)
        out = _empty()
        kind = type(stmt)
        if kind is ast.If:
            return self.if_(stmt, states)  # type: ignore[arg-type]
        if kind in LOOPS:
            return self.loop(stmt, states)
        if kind is ast.With or kind is ast.AsyncWith:
            return self.block(stmt.body, states)  # type: ignore[attr-defined]
        if kind in _TRY:
            return self.try_(stmt, states)
        if kind is ast.Match:
            for case in stmt.cases:  # type: ignore[attr-defined]
                self.merge(out, self.block(case.body, states))
            out["next"].extend(states)  # no case matched
            return out
        jump = {ast.Continue: "continue", ast.Break: "break", ast.Return: "return", ast.Raise: "raise"}.get(kind)
        if jump is not None:
            out[jump] = [_push(s, Event(JUMP, stmt)) for s in states]
            return out
        out["next"] = states
        return out

    def merge(self, into: _Outcomes, more: _Outcomes) -> None:
        for name, states in more.items():
            into[name] = self.fair(into[name], states)

    def if_(self, stmt: ast.If, states: list[_State]) -> _Outcomes:
        test = stmt.test
        if isinstance(test, ast.Constant):
            return self.block(stmt.body if test.value else stmt.orelse, states)
        key, polarity, if_true, if_false = self.test(stmt)
        sides: tuple[list[_State], list[_State]] = ([], [])
        # One event per side and kind, shared by every path through it (an event per path and
        # ``if`` would be most of the model's memory in a function past MAX_PATHS).
        free = (Event(BRANCH, stmt, taken=True), Event(BRANCH, stmt, taken=False))
        forced = (Event(BRANCH, stmt, taken=True, forced=True), Event(BRANCH, stmt, taken=False, forced=True))
        for chain, decided in states:
            known = decided.get(key)
            if known is not None:
                side = 0 if known == polarity else 1
                sides[side].append(((forced[side], chain), decided))
                continue
            for side, facts in ((0, if_true), (1, if_false)):
                now = {**decided, **facts} if facts else decided
                sides[side].append(((free[side], chain), now))
        body, orelse = self.split(*sides)
        out = self.block(stmt.body, body)
        self.merge(out, self.block(stmt.orelse, orelse))
        return out

    def loop(self, stmt: ast.stmt, states: list[_State]) -> _Outcomes:
        body = self.block(stmt.body, [_push(s, Event(LOOP, stmt)) for s in states])  # type: ignore[attr-defined]
        ended = [_push(_push(s, Event(ITER, stmt)), Event(EXIT, stmt)) for s in (*body["next"], *body["continue"])]
        out = self.block(stmt.orelse, ended)  # type: ignore[attr-defined]
        out["next"] = self.cap(out["next"] + [_push(s, Event(EXIT, stmt)) for s in body["break"]])
        for name in ("return", "raise"):
            out[name] = self.cap(out[name] + body[name])
        return out

    def try_(self, stmt: ast.stmt, states: list[_State]) -> _Outcomes:
        out = self.block(stmt.body, states)  # type: ignore[attr-defined]
        if stmt.orelse:  # type: ignore[attr-defined]
            rest = self.block(stmt.orelse, out.pop("next"))  # type: ignore[attr-defined]
            out["next"] = rest.pop("next")
            self.merge(out, rest)
        for handler in stmt.handlers:  # type: ignore[attr-defined]
            if any(id(s) in self.relevant for s in handler.body):
                self.merge(out, self.block(handler.body, states))
        final = stmt.finalbody  # type: ignore[attr-defined]
        if not final:
            return out
        # Every way out of the try runs the finally block first, then goes where it was going.
        result = _empty()
        for name, pending in out.items():
            if pending:
                after = self.block(final, pending)
                result[name].extend(after.pop("next"))
                self.merge(result, after)
        return result
