"""GradScaler's step-order assertions, explained: what order was broken, and the corrected order.

``torch.amp.GradScaler`` keeps a per-optimizer stage (READY -> UNSCALED -> STEPPED, back to READY
at ``update()``) and raises when a call comes out of turn.  Every such message of the installed
torch (``torch/amp/grad_scaler.py``) is listed in ``ORDER_RULES`` with the order it enforces in
plain words and the corrected order as code to paste.  Some messages have more than one cause;
the GradScaler watcher knows the scaler's state when the call raised (``OrderContext``) and
picks the variant that fits, e.g. ``update()`` on a micro-batch that did not step (gradient
accumulation) versus ``update()`` called twice.  Every one of them is ``UNSCALE_ORDER_ERROR``.

>>> rule = explain_order("No inf checks were recorded prior to update.", OrderContext("update", backwards=1))
>>> rule.variant, rule.corrected.splitlines()[1]
('accumulation', 'if (i + 1) % accum_steps == 0:')
>>> explain_order("CUDA out of memory") is None
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ORDER_RULES", "OrderContext", "OrderRule", "explain_order"]

_STEP = """\
scaler.scale(loss).backward()
scaler.unscale_(optimizer)          # optional: only to clip or measure the gradients
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
scaler.step(optimizer)
scaler.update()
optimizer.zero_grad(set_to_none=True)"""

_ACCUMULATION = """\
scaler.scale(loss / accum_steps).backward()
if (i + 1) % accum_steps == 0:
    scaler.unscale_(optimizer)      # optional: only to clip or measure the gradients
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()                 # at the boundary only, right after scaler.step
    optimizer.zero_grad(set_to_none=True)"""

_ONE_UNSCALE = """\
scaler.scale(loss).backward()
scaler.unscale_(optimizer)          # once per optimizer per step
grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # log this norm
scaler.step(optimizer)              # sees that unscale_ ran and does not unscale again
scaler.update()"""

_MULTI = """\
scaler.scale(loss_d).backward()
scaler.step(optimizer_d)            # once per optimizer
scaler.scale(loss_g).backward()
scaler.step(optimizer_g)
scaler.update()                     # once per iteration, after every scaler.step"""

_GRADS = """\
optimizer.zero_grad(set_to_none=True)    # before the forward, never between backward and step
with torch.autocast(device_type, dtype=torch.float16):
    loss = loss_fn(model(x), y)          # must depend on the parameters of every optimizer stepped below
scaler.scale(loss).backward()
if not frozen:                           # step an optimizer only when its parameters were trained
    scaler.step(optimizer)
scaler.update()"""

_SAME_SCALER = """\
scaler = torch.amp.GradScaler(device_type)   # one scaler for every loss and optimizer
scaler.scale(loss).backward()                # not loss.backward(), not another scaler's scale()
scaler.step(optimizer)
scaler.update()"""

_SAVE = """\
scaler.step(optimizer)
scaler.update()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict()}, path)   # the state dict, after update()"""


@dataclass(frozen=True)
class OrderContext:
    """The scaler's state when a call raised (what the GradScaler watcher knows)."""

    call: str
    """The GradScaler method that raised: ``unscale_``, ``step``, ``update`` (or ``""``)."""
    backwards: int = 0
    """Backward passes since the last ``update()``."""
    stepped: bool = False
    """``step()`` ran since the last ``update()``."""
    other_scaler_scaled: bool = False
    """Another GradScaler scaled a loss in this run."""
    optimizers: int = 1
    """Optimizers the script created (with several, a second step() is a loop over them gone wrong)."""


@dataclass(frozen=True)
class OrderRule:
    """One assertion of GradScaler (one cause of it)."""

    needle: str
    """The text torch raises (a substring of its message)."""
    variant: str
    """Which cause of that message (``default`` when it has one)."""
    violated: str
    """The order that was broken, in plain words."""
    corrected: str
    """The corrected order, as code to paste."""

    def message(self, text: str) -> str:
        """The finding's message for GradScaler's exception text ``text``."""
        first = (text.strip().splitlines() or [""])[0]
        return f"GradScaler's call order was broken ({first!r}): {self.violated}"

    @property
    def fix(self) -> str:
        return f"call GradScaler in this order (ready to paste):\n{self.corrected}"

    def evidence(self, call: str | None = None) -> dict[str, Any]:
        made: dict[str, Any] = {"assertion": self.needle, "variant": self.variant, "corrected_order": self.corrected}
        if call:
            made["call"] = f"scaler.{call}()"
        return made


ORDER_RULES = (
    OrderRule("No inf checks were recorded prior to update", "accumulation",
              "scaler.update() ran on a micro-batch that did not step the optimizer: update() consumes the inf "
              "checks that scaler.step(optimizer) (or unscale_) records, so with gradient accumulation it "
              "belongs to the accumulation boundary, right after scaler.step(optimizer)", _ACCUMULATION),
    OrderRule("No inf checks were recorded prior to update", "default",
              "scaler.update() ran although no scaler.step(optimizer) or scaler.unscale_(optimizer) ran since the "
              "last update(): update() must follow the step of the same iteration, once", _STEP),
    OrderRule("unscale_() has already been called on this optimizer", "default",
              "scaler.unscale_(optimizer) ran twice for the same optimizer before scaler.update(): gradients are "
              "unscaled once per step (a second call would divide them by the scale again)", _ONE_UNSCALE),
    OrderRule("unscale_() is being called after step()", "default",
              "scaler.unscale_(optimizer) ran after scaler.step(optimizer) in the same iteration: step() already "
              "unscaled and applied the gradients, so clipping or measuring them belongs before step()", _STEP),
    OrderRule("step() has already been called since the last update()", "missing_update",
              "scaler.step(optimizer) ran again for a new batch but scaler.update() never ran after the previous "
              "step: every iteration that steps must end with scaler.update()", _STEP),
    OrderRule("step() has already been called since the last update()", "default",
              "scaler.step(optimizer) ran twice for the same optimizer before scaler.update(): step each optimizer "
              "once per iteration, then update() once", _MULTI),
    OrderRule("No inf checks were recorded for this optimizer", "default",
              "scaler.step(optimizer) found no gradient on any of the optimizer's parameters, so there was "
              "nothing to check for inf/NaN: its gradients were cleared between backward and step "
              "(optimizer.zero_grad()), or the loss that was backpropagated does not depend on them (frozen, "
              "detached, or computed under torch.no_grad()); step an optimizer only in the iterations that "
              "train its parameters", _GRADS),
    OrderRule("_scale is None", "other_scaler",
              "this GradScaler never scaled a loss (scale() creates its scale), yet it is asked to unscale, "
              "step or update: the loss was scaled by another GradScaler, so this one never saw its backward",
              _SAME_SCALER),
    OrderRule("_scale is None", "default",
              "this GradScaler never scaled a loss (scale() creates its scale), yet it is asked to unscale, step "
              "or update: the loss was backpropagated with loss.backward() instead of "
              "scaler.scale(loss).backward()", _SAME_SCALER),
    OrderRule("_growth_tracker is None", "default",
              "this GradScaler never scaled a loss, yet it is asked to unscale, step or update", _SAME_SCALER),
    OrderRule("may only be pickled at the beginning of an iteration", "default",
              "the GradScaler object was pickled (torch.save(scaler), copy.deepcopy) between scaler.step() and "
              "scaler.update(): it may only be saved before the first step or after update(); checkpoints "
              "hold scaler.state_dict()", _SAVE),
)


def _variant(rule_needle: str, ctx: OrderContext | None) -> str:
    if ctx is None:
        return "default"
    if rule_needle.startswith("No inf checks were recorded prior") and ctx.backwards and not ctx.stepped:
        return "accumulation"
    if rule_needle.startswith("step() has already") and ctx.backwards and ctx.optimizers <= 1:
        return "missing_update"
    if rule_needle == "_scale is None" and ctx.other_scaler_scaled:
        return "other_scaler"
    return "default"


def explain_order(text: str, ctx: OrderContext | None = None) -> OrderRule | None:
    """The rule for GradScaler's message ``text`` (its variant chosen from ``ctx``), else None."""
    for rule in ORDER_RULES:
        if rule.needle in text and rule.variant == _variant(rule.needle, ctx):
            return rule
    return None
