"""A training script's first optimizer steps, captured as the script runs them: what ``ampkit preflight
SCRIPT`` replays under each format.

``capture_first_steps`` runs the script the way ``ampkit doctor SCRIPT`` does (``script.target``: the same
target checks, ``sys.argv``, ``sys.path[0]`` and ``-m`` handling) under the doctor's watchers
(``script.context``: the same model discovery and the same captures, ``script.models``), and stops it once
``steps`` optimizer steps have ended.  The stop is ``_Stop``, raised from the step observation
(``RunState.on_step``, called by ``failures.end_iteration`` once the step's window of captures has closed):
a ``BaseException``, so that the script's own ``except Exception`` lets it through, while its ``finally``
blocks and ``with`` exits still run.  Everything the run changed is put back before the call returns.

Costs: those of a doctor run for the steps it lasts (no replay runs meanwhile: a failing step is not
reported here), plus per kept forward one copy of each input that autograd computed (``_released``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_map

from ampkit._util.frames import UserFrames
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.target import run_as_main, script_target

__all__ = ["FirstSteps", "FirstStepsEnd", "capture_first_steps"]

FirstStepsEnd = Literal["steps", "exit", "exception"]
"""How the captured run ended: stopped after the steps asked for, the script's own end (``sys.exit`` included)
before them, or an exception the script raised before them."""


@dataclass(frozen=True)
class FirstSteps:
    """The root model forwards of a script's first optimizer steps, and how its run ended."""

    captures: list[Capture]
    """The root forwards of each optimizer step, in the order they ran: one per step, or several when a step
    accumulates gradients over micro-batches (``Capture.step`` tells the steps apart).  Each carries the
    gradients its outputs received, ready for ``diagnose.replay.replay``."""
    steps: int
    """Optimizer steps the script took (skipped ones included): the number asked for when ``ended`` is
    ``steps``, fewer otherwise."""
    ended: FirstStepsEnd
    error: str | None = None
    """The exception's type and text when ``ended`` is ``exception``; the exit status when the script exited
    with one that is not 0; else None."""
    forwards: int = 0
    """Root model forwards the script ran (0: it never called a model, an ``nn.Module`` with parameters)."""
    location: str | None = None
    """The user's line that called the model (the first captured forward's ``file:line``)."""

    @property
    def missing(self) -> str | None:
        """What the script never did that a replay needs (for the caller's usage error), or None."""
        if self.forwards == 0:
            return "a call of a model (an nn.Module with parameters)"
        if self.steps == 0:
            return "an optimizer step (optimizer.step() or scaler.step(optimizer))"
        if not self.captures:
            return "a model call inside its first optimizer steps"
        return None


class _Stop(BaseException):
    """Raised at the end of the last optimizer step wanted: a BaseException, like KeyboardInterrupt, so that
    the script's ``except Exception`` does not swallow it."""


class _StepCatcher:
    """The ``RunState.on_step`` callback: keeps each step's captures until ``steps`` steps, then stops the script."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.captures: list[Capture] = []
        self.seen = 0

    def __call__(self, window: list[Capture]) -> None:
        if self.seen < self.steps:  # a script that swallowed the stop and stepped again adds nothing
            self.seen += 1
            self.captures.extend(_released(cap) for cap in window)
        if self.seen >= self.steps:
            raise _Stop


def capture_first_steps(target: str | os.PathLike[str], args: Sequence[str] = (), *, module: bool = False,
                        steps: int = 2) -> FirstSteps:
    """Run a training script as ``__main__`` until ``steps`` optimizer steps have ended; their root forwards.

    The script runs exactly as written: the captured forwards are whatever the script ran, fp32 or under its
    own autocast (``Capture.autocast``), with the loss scale its GradScaler applied (``Capture.scale``).  A
    caller that wants them in fp32 and in other formats replays them so (``diagnose.replay.replay``).

    Algorithm: the doctor's watchers are installed (``script.context.Context``, no replays); each primary
    optimizer's step end hands its window of captured forwards to a ``_StepCatcher``, which keeps them
    without the script's autograd graph and raises ``_Stop`` at the ``steps``-th.  Then the watchers' hooks
    and torch patches are undone, and ``sys.argv``, ``sys.path``, ``__main__``, the working directory and
    the signal handlers are put back.  The models keep the weights the last captured step left them with.

    Args:
        target: the script's path (or, with ``module=True``, a module name as for ``python -m``).
        args: the script's own arguments (``sys.argv[1:]`` inside it).
        steps: how many optimizer steps to capture (at least 1).

    Returns:
        ``FirstSteps``; when the script never called a model or never stepped an optimizer, with no
        captures, ``ended`` saying how it ended and ``missing`` what it never did.

    Raises:
        ValueError: ``steps`` is less than 1.
        FileNotFoundError: ``target`` is not an existing file (``module=False``).
        ModuleNotFoundError: ``python -m target`` would find no module (``module=True``).
        KeyboardInterrupt: Ctrl-C while the script ran (after everything was put back).
    """
    if steps < 1:
        raise ValueError(f"capture_first_steps(steps={steps!r}): steps must be at least 1")
    script = script_target(target, module=module)
    catcher = _StepCatcher(steps)
    ctx = Context(UserFrames([str(script.folder)]), on_step=catcher)
    patches = PatchSet()
    try:
        ctx.install(patches)
    except BaseException:
        patches.restore()
        raise
    ended: FirstStepsEnd = "exit"
    error: str | None = None
    try:
        with _process_state_kept():
            run_as_main(script, args)
    except _Stop:
        pass
    except SystemExit as exc:
        error = _exit_text(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        ended, error = "exception", f"{type(exc).__name__}: {exc}"
    finally:
        patches.restore()
    if catcher.seen >= steps:
        ended, error = "steps", None  # stopped, even when the script caught the stop and ended on its own
    caps = catcher.captures
    return FirstSteps(captures=caps, steps=catcher.seen, ended=ended, error=error, forwards=ctx.state.forwards.total,
                      location=caps[0].location if caps else None)


def _exit_text(code: Any) -> str | None:
    """What ``sys.exit(code)`` says as ``FirstSteps.error``: None for a clean exit, else the status or the
    message (``sys.exit("no data")``)."""
    if code is None or code == 0:
        return None
    return f"exit status {code}" if isinstance(code, int) else str(code)


def _released(cap: Capture) -> Capture:
    """``cap`` without references into the script's autograd graph, which would keep the whole step's
    activations alive for as long as the capture: the outputs' autograd nodes (the doctor drops them at
    backward) go, an input autograd computed (another model's output) becomes a leaf copy with the same
    values that requires grad as before, and a gradient built with ``create_graph`` is detached."""
    cap.grad_fns = []
    cap.args, cap.kwargs = tree_map(_leaf, cap.args), tree_map(_leaf, cap.kwargs)
    cap.grads = [None if g is None else g.detach() for g in cap.grads]
    cap.grads_fp32 = [None if g is None else g.detach() for g in cap.grads_fp32]
    return cap


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.grad_fn is not None:
        return x.detach().requires_grad_(True)
    return x


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Put back what a script stopped half-way may have changed in this process, which goes on to replay its
    steps: the working directory, the whole ``sys.path`` (``run_as_main`` puts back ``sys.path[0]``) and the
    signal handlers (a training loop often installs its own for SIGTERM or SIGUSR1)."""
    cwd, path = os.getcwd(), sys.path[:]
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for sig, handler in handlers.items():
            # None: a handler not installed from Python, which cannot be put back from here
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
