"""Forward hooks that survive ``copy.deepcopy`` of the module they watch.

``copy.deepcopy(model)`` copies the module's hook dictionaries.  A hook that is a bound method (or a
``functools.partial`` of one) is deep-copied with the object behind it, and a watcher holds what
cannot be copied (locks, open files: "cannot pickle '_thread.lock' object"), so a script's
``ema = copy.deepcopy(model)`` or ``best = copy.deepcopy(model)`` would fail only because ampkit
watches the model.  ``own_hook`` wraps the hook in a plain function, which deepcopy copies by
reference, and makes it do nothing on any module but the one it was registered on: the copy is a
clean model, not a second watched one.

>>> import copy, threading
>>> from torch import nn
>>> class Watch:
...     lock = threading.Lock()
...     seen = 0
...     def pre(self, module, args):
...         self.seen += 1
>>> watch, model = Watch(), nn.Linear(2, 2)
>>> _ = model.register_forward_pre_hook(own_hook(model, watch.pre))
>>> twin = copy.deepcopy(model)
>>> _ = model(torch.ones(1, 2)), twin(torch.ones(1, 2))
>>> watch.seen
1
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch  # noqa: F401  (the doctest's tensors)
from torch import nn

__all__ = ["own_hook"]


def own_hook(module: nn.Module, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a module hook of ``module`` alone (any hook signature: the module comes first).

    Costs one weak-reference call per forward."""
    target = weakref.ref(module)

    def run(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if mod is not target():
            return None  # a deep copy of the watched module: not watched
        return hook(mod, *args, **kwargs)

    return run
