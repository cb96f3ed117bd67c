"""The traceback of a script's exception, as Python would print it for the script (printed whether or
not the doctor explains the exception: the explanation follows it).

Two kinds of frames would not be there without the doctor, and both are left out:

* the runner's own frames below the script's first frame (``runpy`` and ``run_script``);
* the wrappers the doctor installed (``PatchSet.wrap``) where they only passed the call on: a
  ``clip_grad_norm_`` that raises inside torch shows the user's line, then torch's frames.

A wrapper frame is left out only when the next frame runs the very function it wrapped (after
``UserFrames.call``, the one helper a wrapper may call it through).  When the doctor's own code
raised, its frames stay: that traceback is a report about the doctor.
"""

from __future__ import annotations

import sys
import traceback
import types
from collections.abc import Mapping, Set

from ampkit._util.frames import UserFrames

__all__ = ["print_user_traceback", "user_traceback"]

_RELAYS = frozenset({UserFrames.call.__code__})
"""Helpers a wrapper calls its original through: skipped between the wrapper and the original."""


def user_traceback(exc: BaseException, code: UserFrames,
                   wrapped: Mapping[types.CodeType, Set[types.CodeType]]) -> types.TracebackType | None:
    """``exc``'s traceback from its first user frame on, without pass-through wrapper frames.

    ``wrapped`` maps a wrapper's code to the codes of the functions it wraps (``PatchSet.wrapped``).
    With no user frame the whole traceback is kept.
    """
    entries: list[types.TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    start = next((i for i, t in enumerate(entries) if code.is_user(t.tb_frame.f_code.co_filename)), 0)
    kept: list[types.TracebackType] = []
    i = start
    while i < len(entries):
        originals = wrapped.get(entries[i].tb_frame.f_code)
        if originals:
            j = i + 1
            while j < len(entries) and entries[j].tb_frame.f_code in _RELAYS:
                j += 1
            if j < len(entries) and entries[j].tb_frame.f_code in originals:
                i = j
                continue
        kept.append(entries[i])
        i += 1
    out: types.TracebackType | None = None
    for t in reversed(kept):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def print_user_traceback(exc: BaseException, code: UserFrames,
                         wrapped: Mapping[types.CodeType, Set[types.CodeType]]) -> None:
    """Print ``user_traceback`` of ``exc`` to stderr, with its message (and any chained exceptions)."""
    traceback.print_exception(type(exc), exc, user_traceback(exc, code, wrapped), file=sys.stderr)
