"""Where an explained exception happened: which forward or training step, and the user's call chain.

A line number alone does not say whether ``scores.masked_fill(mask, -1e9)`` failed in training
or in the validation loop.  So every exception the doctor explains also names its place:

* raised inside a model's forward (under a ``module(...)`` call; the outermost one is the model
  the user called): the kind of forward, from the state the model watcher recorded
  when that forward began (``Capture.training`` / ``Capture.grad_enabled``; a model the watcher
  never hooked falls back to its ``training`` flag) -- a *training* forward (train mode, autograd
  recording), an *eval* forward (``model.eval()``) or a *no-grad* forward (train mode under
  ``torch.no_grad`` / ``torch.inference_mode``);
* raised anywhere else (a GradScaler call, the loss, the optimizer): training, at its step;

and the user's frames on the way there (library frames left out), innermost last, the last
``CHAIN_LIMIT`` of them: ``train.py:88 train() -> train.py:41 Trainer.step() ->
model.py:20 Block.forward()``.  The step is the number of optimizer steps before that point
(the finding's ``step``).

>>> Where("eval_forward", 16, "model", ["train.py:60", "train.py:31 evaluate()"], False).describe()
'an eval forward of `model` (model.eval(), gradients off) after 16 optimizer steps'
>>> Where("training_step", 3, None, ["train.py:40"]).sentence()
'; where: training after 3 optimizer steps, outside any forward; call chain: train.py:40'
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.models import ModelWatch

__all__ = ["CHAIN_LIMIT", "PHASES", "Where", "where_now", "where_raised", "where_sentence"]

CHAIN_LIMIT = 5
"""User frames shown, innermost last (a deep trainer stack would drown the message)."""

_CALL_IMPL = nn.Module._call_impl.__code__
"""The frame of every ``module(...)`` call (hooks included), with the module as ``self``: the
outermost one on a stack is the model the user called, whatever its forward is named."""

PHASES = ("training_forward", "eval_forward", "no_grad_forward", "training_step")
"""The values of a finding's ``evidence["raised_in"]``."""


@dataclass(frozen=True)
class Where:
    """The place of an exception in training (see the module docstring)."""

    phase: str
    """One of ``PHASES``."""
    step: int | None
    """Optimizer steps before the exception."""
    model: str | None
    """The model whose forward raised, as the script names it; None outside any forward."""
    call_chain: list[str]
    """The user's frames, ``file:line function()``, outermost first."""
    grad_enabled: bool | None = None
    """Whether autograd recorded during that forward; None when unknown or outside any forward."""

    def describe(self) -> str:
        model = f"`{self.model}`"
        after = "" if self.step is None else f" after {self.step} optimizer step{'' if self.step == 1 else 's'}"
        if self.phase == "training_forward":
            return f"the training forward of {model}{after}"
        if self.phase == "eval_forward":
            grads = {True: ", gradients on", False: ", gradients off", None: ""}[self.grad_enabled]
            return f"an eval forward of {model} (model.eval(){grads}){after}"
        if self.phase == "no_grad_forward":
            return f"a no-grad forward of {model} (train mode, gradients off){after}"
        return f"training{after}, outside any forward"

    def sentence(self) -> str:
        """The clause appended to the finding's message."""
        return where_sentence(self.evidence())

    def evidence(self) -> dict[str, Any]:
        return {"where": self.describe(), "raised_in": self.phase, "call_chain": self.call_chain[-CHAIN_LIMIT:]}


def where_sentence(evidence: dict[str, Any]) -> str:
    """The message clause for a finding's ``where`` evidence (``""`` without one): also used when a
    replayed op-level finding takes the place of an explained exception's finding."""
    if "where" not in evidence:
        return ""
    chain = evidence.get("call_chain") or []
    return f"; where: {evidence['where']}" + (f"; call chain: {' -> '.join(chain)}" if chain else "")


def where_raised(tb: types.TracebackType | None, frames: UserFrames, models: ModelWatch | None,
                 step: int | None) -> Where:
    """The place of an exception from its traceback (after it propagated to the doctor)."""
    stack = []
    at = tb
    while at is not None:
        stack.append(at.tb_frame)
        at = at.tb_next
    return _where(stack, frames.call_chain(tb), models, step)


def where_now(frames: UserFrames, models: ModelWatch | None, step: int | None, *, skip: int = 1) -> Where:
    """The place of an exception being raised right now (a watcher's wrapper, before it propagates)."""
    stack: list[types.FrameType] = []
    frame: types.FrameType | None = sys._getframe(skip)
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    stack.reverse()
    return _where(stack, frames.call_chain(skip=skip + 1), models, step)


def _where(stack: list[types.FrameType], chain: list[str], models: ModelWatch | None, step: int | None) -> Where:
    module = next((f.f_locals.get("self") for f in stack if f.f_code is _CALL_IMPL), None)
    if not isinstance(module, nn.Module):
        return Where("training_step", step, None, chain)
    cap = models.last if models is not None and models.last is not None and models.last.root is module else None
    training = cap.training if cap is not None else module.training
    grad = cap.grad_enabled if cap is not None else None
    phase = "eval_forward" if not training else "training_forward" if grad is not False else "no_grad_forward"
    label = models.label(module) if models is not None else type(module).__name__
    return Where(phase, step, label, chain, grad)
