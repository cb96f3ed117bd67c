"""A module's own arithmetic in fp32, its children's in low precision: which of them lost the precision.

When keeping a module in fp32 restores a precision loss and so does keeping one of its children
alone, the effect scan (``step.bisect.effect_culprit``) names the innermost: the child.  That is
wrong when the damage is done by the parent's own ops on the child's output: positions built with
``torch.arange(T, dtype=q.dtype)``, a cumulative sum and the differences of its shifted copies.
Keeping the child in fp32 fixes those only because its fp32 output drags the parent's ops into fp32
with it.  The test: keep the parent's own ops in fp32 while each direct child still runs in low
precision and hands back its rounded output (upcast, so that the parent's ops stay fp32).  If that
fixes the step, the children's rounding is harmless and the parent's own arithmetic did the damage;
if not (a phase rounded by a child's bf16 Linear before the parent's ``sin``), the child did.

Cost: one forward trial, only when a child and an ancestor of it both fixed the step alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ampkit.diagnose.core.modules import upcast
from ampkit.policy import is_kept, keep_fp32, release_fp32

if TYPE_CHECKING:
    from ampkit.diagnose.step.session import Session

__all__ = ["own_arithmetic_culprit", "own_ops_in_fp32"]


class _Trial(Protocol):
    """What the culprit rule reads and writes of a bisection trial (``step.bisect.Trial``)."""

    keep: list[str]
    fixed: bool


@contextmanager
def own_ops_in_fp32(model: nn.Module, name: str, device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Run module ``name`` of ``model`` in fp32 and each of its direct children under ``dtype`` autocast,
    their outputs upcast to fp32 (what the parent's own ops receive is the children's rounded output).

    >>> inner = nn.Linear(4, 4)
    >>> outer = nn.Sequential(inner)
    >>> with own_ops_in_fp32(outer, "", "cpu", torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     y = outer(torch.randn(2, 4))
    >>> y.dtype, torch.equal(y, y.bfloat16().float())
    (torch.float32, True)
    """
    parent = dict(model.named_modules())[name]
    applied = not is_kept(parent)
    if applied:
        keep_fp32(parent, device_type)
    entered: list[torch.autocast] = []

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        region = torch.autocast(device_type, dtype=dtype)
        region.__enter__()
        entered.append(region)

    def post(module: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        if entered:
            entered.pop().__exit__(None, None, None)
        return tree_map(upcast, out)

    handles = [h for child in parent.children()
               for h in (child.register_forward_pre_hook(pre, with_kwargs=True),
                         child.register_forward_hook(post, with_kwargs=True, always_call=True))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if applied:
            release_fp32(parent)


def own_arithmetic_culprit(effects: Mapping[str, _Trial], culprit: str | None, session: Session,
                           trial: Callable[[], _Trial]) -> str | None:
    """The effect scan's culprit, or its nearest ancestor that also fixed the step alone when that
    ancestor's own ops in fp32 (``own_ops_in_fp32``, run by ``trial``, a trial keeping nothing else)
    fix it too: the child then fixed it only by dragging the ancestor's ops into fp32."""
    if culprit is None or not effects[culprit].fixed:
        return culprit
    fixed = [n for n, t in effects.items() if t.fixed and n and culprit.startswith(n + ".")]
    if not fixed:
        return culprit
    parent = max(fixed, key=len)
    with own_ops_in_fp32(session.work, parent, session.device.type, session.precision.dtype):
        own = trial()
    own.keep = [f"{parent} (its own ops; its children in low precision)"]  # the trial's record, not a name
    return parent if own.fixed else culprit
