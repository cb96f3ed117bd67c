"""The ``Task`` protocol: what ``ampkit verify`` (and ``ampkit doctor TASK``) trains, and how to load one.

A task bundles everything the FP32-baseline protocol needs to run the *same* experiment under
several precisions: a model factory that is deterministic given a seed, an optimizer factory,
a deterministic batch stream, the loss, and an evaluation whose metrics each say whether
higher or lower is better.

Tasks are referenced three ways (``load_task``):

- a built-in name: ``tinygpt`` (the default) or ``digits``;
- a file: ``path/to/file.py`` or ``path/to/file.py:attr``;
- a module: ``package.module:attr`` (or ``package.module``).

``attr`` may name a ``Task`` instance, a class (instantiated without arguments) or a function
returning a task.  Without ``attr`` the module's ``task`` attribute is used, else its only task.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import keyword
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["BUILTIN_TASKS", "Task", "TaskBase", "TaskLoadError", "TaskSize", "check_task", "load_task", "split_task_ref"]

BUILTIN_TASKS: dict[str, str] = {
    "tinygpt": "ampkit.tasks.tinygpt:TinyGPTTask",
    "digits": "ampkit.tasks.digits:DigitsTask",
}
"""Built-in task names and the ``module:attr`` they resolve to."""

DIRECTIONS = ("higher", "lower")


class TaskLoadError(ValueError):
    """A task reference that cannot be resolved; the message says what was looked for where."""


@runtime_checkable
class Task(Protocol):
    """One experiment, runnable under any precision.

    ``build_model(seed)`` must return the same fp32 weights on CPU for the same seed (the harness
    hashes them and refuses runs whose initial weights differ); ``batches(seed, device)`` must
    yield the same batches in the same order for the same seed.  ``loss`` is called inside
    ``mp.autocast()``; ``evaluate`` is called under ``torch.no_grad()`` and the same autocast.
    """

    name: str
    metrics: dict[str, str]
    """Metric name -> ``"higher"`` or ``"lower"`` (which direction is better)."""
    samples_per_batch: int
    tokens_per_batch: int | None

    def build_model(self, seed: int) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer: ...

    def batches(self, seed: int, device: torch.device) -> Iterator[Any]: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...


@dataclass(frozen=True)
class TaskSize:
    """One rung of a task's size ladder: ``ampkit verify --time-budget`` may run a smaller rung.

    A task offers a ladder with ``sizes`` (largest first), ``size`` (the rung it is, or None for
    a custom shape) and ``resized(name)``.
    """

    name: str
    steps: int
    """Steps at which this size's fp32 noise band resolves verify's default tolerances (docs/verify.md)."""
    step_flops: float
    """Estimated training FLOPs of one step: scales a step time probed at one size to another."""
    shape: str
    """What the size is, for the report (``d_model 128, 2 layers, context 64``)."""


class TaskBase:
    """Convenience base for tasks: AdamW by default and optional run defaults.

    Subclasses set ``name``, ``metrics``, ``samples_per_batch`` (and ``tokens_per_batch`` for
    token models) and implement ``build_model``, ``batches``, ``loss`` and ``evaluate``.
    ``default_steps`` / ``default_warmup`` / ``default_eval_every`` are what ``ampkit verify``
    uses when the command line does not say.

    >>> class Quadratic(TaskBase):
    ...     name, metrics, samples_per_batch = "quadratic", {"mse": "lower"}, 4
    ...     def build_model(self, seed):
    ...         torch.manual_seed(seed)
    ...         return nn.Linear(2, 1)
    ...     def batches(self, seed, device):
    ...         g = torch.Generator().manual_seed(seed)
    ...         while True:
    ...             yield torch.randn(4, 2, generator=g).to(device)
    ...     def loss(self, model, batch):
    ...         return model(batch).float().pow(2).mean()
    ...     def evaluate(self, model, device):
    ...         return {"mse": float(model(torch.ones(1, 2, device=device)).float().pow(2).mean())}
    >>> isinstance(Quadratic(), Task)
    True
    >>> check_task(Quadratic(), "doctest").name
    'quadratic'
    """

    name: str = "task"
    metrics: dict[str, str] = {}  # noqa: RUF012 - subclasses replace it, never mutate it
    samples_per_batch: int = 1
    tokens_per_batch: int | None = None
    default_steps: int = 200
    default_warmup: int = 10
    default_eval_every: int = 50
    lr: float = 1e-3

    def build_model(self, seed: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_model(seed) is not implemented")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW, fused where the device supports it (no host sync when the engine skips a step)."""
        device = next(model.parameters()).device
        fused = device.type in ("cpu", "cuda", "xpu", "mps")
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01, fused=fused)

    def batches(self, seed: int, device: torch.device) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__}.batches(seed, device) is not implemented")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.loss(model, batch) is not implemented")

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__}.evaluate(model, device) is not implemented")


def check_task(obj: Any, ref: str) -> Task:
    """Return ``obj`` as a ``Task`` or raise ``TaskLoadError`` naming what is missing or wrong."""
    if inspect.isclass(obj) or not isinstance(obj, Task):
        required = [n for n in ("name", "metrics", "samples_per_batch", "tokens_per_batch", "build_model",
                                "build_optimizer", "batches", "loss", "evaluate") if not hasattr(obj, n)]
        raise TaskLoadError(
            f"task {ref!r} resolved to {type(obj).__name__} {_short(obj)}, which is not an ampkit.Task: "
            f"it lacks {', '.join(required)}. Subclass ampkit.TaskBase or provide those members"
        )
    if not isinstance(obj.name, str) or not obj.name:
        raise TaskLoadError(f"task {ref!r}: name must be a non-empty string, got {obj.name!r}")
    metrics = obj.metrics
    if not isinstance(metrics, dict) or not metrics:
        raise TaskLoadError(
            f"task {ref!r}: metrics must be a non-empty dict of metric name -> 'higher' or 'lower', got {metrics!r}"
        )
    bad = {k: v for k, v in metrics.items() if not isinstance(k, str) or v not in DIRECTIONS}
    if bad:
        raise TaskLoadError(
            f"task {ref!r}: metrics {bad!r} must map a name to 'higher' or 'lower' (which direction is better)"
        )
    spb = obj.samples_per_batch
    if isinstance(spb, bool) or not isinstance(spb, int) or spb < 1:
        raise TaskLoadError(f"task {ref!r}: samples_per_batch must be an int >= 1, got {spb!r}")
    tpb = obj.tokens_per_batch
    if tpb is not None and (isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1):
        raise TaskLoadError(f"task {ref!r}: tokens_per_batch must be None or an int >= 1, got {tpb!r}")
    return obj


def load_task(ref: str) -> Task:
    """Resolve a task reference (see the module docstring) and check it satisfies ``Task``.

    >>> load_task("tinygpt").name
    'tinygpt'
    >>> load_task("no-such-task")
    Traceback (most recent call last):
    ...
    ampkit.tasks.base.TaskLoadError: task 'no-such-task' is not a built-in task (digits, tinygpt), ...
    """
    ref = ref.strip()
    if not ref:
        raise TaskLoadError(f"an empty task reference; use a built-in name ({', '.join(sorted(BUILTIN_TASKS))}), "
                            "path/to/file.py[:attr] or package.module:attr")
    if ref in BUILTIN_TASKS:
        module_name, attr = BUILTIN_TASKS[ref].split(":")
        return check_task(_resolve(_import_module(module_name, ref), attr, ref), ref)
    path_part, attr_opt = split_task_ref(ref)
    if path_part.endswith(".py") or "/" in path_part or "\\" in path_part:
        module = _import_file(Path(path_part), ref)
    elif attr_opt is not None or "." in path_part:
        module = _import_module(path_part, ref)
    else:
        raise TaskLoadError(
            f"task {ref!r} is not a built-in task ({', '.join(sorted(BUILTIN_TASKS))}), a .py file or a "
            "package.module:attr reference; name a built-in, a file such as ./my_task.py:task, or a module "
            "such as mypkg.tasks:task"
        )
    obj = _resolve(module, attr_opt, ref) if attr_opt is not None else _default_attr(module, ref)
    return check_task(obj, ref)


def split_task_ref(ref: str) -> tuple[str, str | None]:
    """Split ``file.py:attr`` / ``module:attr`` into (file or module, attr or None)."""
    head, sep, tail = ref.rpartition(":")
    # "C:\\x.py" has a colon that is not an attribute separator: the tail must be a dotted name.
    if sep and tail and all(p.isidentifier() and not keyword.iskeyword(p) for p in tail.split(".")):
        return head, tail
    if sep and not tail:
        raise TaskLoadError(f"task {ref!r} ends with ':'; write the attribute after it (file.py:task) or drop the ':'")
    if sep and len(head) != 1:  # not a Windows drive letter
        raise TaskLoadError(f"task {ref!r}: {tail!r} after ':' is not a Python attribute name")
    return ref, None


def _import_module(name: str, ref: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise TaskLoadError(
                f"task {ref!r}: module {name!r} was not found on sys.path (looked for {exc.name!r}); "
                "install the package, run from its directory, or point at the file: path/to/file.py:attr"
            ) from exc
        raise TaskLoadError(f"task {ref!r}: importing module {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise TaskLoadError(f"task {ref!r}: importing module {name!r} raised {type(exc).__name__}: {exc}") from exc


def _import_file(path: Path, ref: str) -> ModuleType:
    path = path.expanduser()
    if not path.is_file():
        where = path.resolve()
        raise TaskLoadError(
            f"task {ref!r}: file {str(where)!r} does not exist" + ("" if path.suffix == ".py" else " (expected a .py file)")
        )
    resolved = path.resolve()
    module_name = f"_ampkit_task_{abs(hash(str(resolved))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise TaskLoadError(f"task {ref!r}: {str(resolved)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered before exec so dataclasses/pickle inside the file can find their own module.
    sys.modules[module_name] = module
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise TaskLoadError(
            f"task {ref!r}: executing {str(resolved)!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def _resolve(module: ModuleType, attr: str, ref: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            available = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
            raise TaskLoadError(
                f"task {ref!r}: {module.__name__ if not module.__name__.startswith('_ampkit_task_') else module.__file__!r} "
                f"has no attribute {attr!r}; public names there: {', '.join(available) or '(none)'}"
            )
        obj = getattr(obj, part)
    return _instantiate(obj, ref)


def _instantiate(obj: Any, ref: str) -> Any:
    # A Task class passes the protocol's isinstance check too (it has every member), so classes
    # are instantiated first.
    if not inspect.isclass(obj) and isinstance(obj, Task):
        return obj
    if callable(obj):
        try:
            return obj()
        except TypeError as exc:
            raise TaskLoadError(
                f"task {ref!r}: {_short(obj)} must be callable without arguments to make a task ({exc})"
            ) from exc
        except Exception as exc:
            raise TaskLoadError(f"task {ref!r}: building the task with {_short(obj)}() raised "
                                f"{type(exc).__name__}: {exc}") from exc
    return obj


def _default_attr(module: ModuleType, ref: str) -> Any:
    if hasattr(module, "task"):
        return _instantiate(module.task, ref)
    found = {
        n: v for n, v in vars(module).items()
        if not n.startswith("_") and ((not inspect.isclass(v) and isinstance(v, Task)) or (
            inspect.isclass(v) and v is not TaskBase and issubclass(v, TaskBase) and v.__module__ == module.__name__))
    }
    if len(found) == 1:
        return _instantiate(next(iter(found.values())), ref)
    where = module.__file__ or module.__name__
    if not found:
        raise TaskLoadError(
            f"task {ref!r}: {where!r} has no attribute 'task' and defines no Task; add `task = MyTask()` "
            "or name the attribute: file.py:attr"
        )
    raise TaskLoadError(
        f"task {ref!r}: {where!r} defines several tasks ({', '.join(sorted(found))}) and no 'task'; "
        f"name one: {ref}:{sorted(found)[0]}"
    )


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."
