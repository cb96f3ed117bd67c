"""Lazy package attributes: ``import ampkit`` stays cheap until a name is used.

A package lists ``{public name: defining module}`` and installs the returned ``__getattr__``
and ``__dir__``; the first access imports the module and caches the value in the package.
This is why ``ampkit lint`` (pure AST) starts without importing torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names live in the modules ``homes`` names.

    >>> getattr_, dir_ = lazy_attributes("ampkit._util", {"dtype_name": "ampkit._util.dtypes"})
    >>> getattr_("dtype_name")("torch.bfloat16")
    'bf16'
    """

    def __getattr__(name: str) -> Any:
        module = homes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
