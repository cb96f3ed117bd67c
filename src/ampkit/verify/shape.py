"""The shape of a verify plan: steps, warm-up and evaluation interval, and the task's size ladder.

``run_shape`` fills in what the command line left out from the task's defaults;
``resized``/``at_size`` move a task (and a plan) to a rung of its size ladder (``sizes`` and
``resized(name)`` on the task: tinygpt's ``SIZES``).  Used by ``ampkit.verify.harness`` to plan and
by ``ampkit.verify.probe`` to try each rung under ``--time-budget``.
"""

from __future__ import annotations

from dataclasses import replace

from ampkit.tasks import Task
from ampkit.verify.plan import Plan, VerifyConfig, VerifyError

__all__ = ["at_size", "resized", "run_shape"]


def run_shape(config: VerifyConfig, task: Task) -> tuple[int, int, int]:
    """Steps, warm-up and evaluation interval: the command line's, else the task's defaults."""
    steps = config.steps if config.steps is not None else int(getattr(task, "default_steps", 200))
    warmup = config.warmup if config.warmup is not None else min(int(getattr(task, "default_warmup", 10)), steps // 2)
    if warmup >= steps:
        raise VerifyError(f"--warmup {warmup} must be smaller than --steps {steps}: throughput is measured on the "
                          "steps after warm-up")
    eval_every = config.eval_every if config.eval_every is not None else min(
        int(getattr(task, "default_eval_every", 50)), steps)
    return steps, warmup, eval_every


def resized(task: Task, size: str) -> Task:
    names = [s.name for s in getattr(task, "sizes", ())]
    if size not in names:
        offered = f"its sizes: {', '.join(names)}" if names else "it offers no size ladder"
        raise VerifyError(f"--size {size!r}: task {task.name!r} has no such size; {offered}")
    return task.resized(size)  # type: ignore[attr-defined, no-any-return]


def at_size(p: Plan, config: VerifyConfig, size: str) -> Plan:
    """``p`` with the task at rung ``size`` of its ladder, and that rung's steps unless the command line set them."""
    task = resized(p.task, size)
    steps, warmup, eval_every = run_shape(config, task)
    return replace(p, task=task, size=size, steps=steps, warmup=warmup, eval_every=eval_every)
