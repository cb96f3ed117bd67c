"""Write a Telemetry's pending records when the interpreter exits without ``close()``.

A run that ends by an exception or ``sys.exit`` would otherwise lose up to ``flush_every - 1``
records, and the last ones are often the steps that went wrong.  The hook holds a weak reference,
so it keeps no Telemetry alive; SIGKILL, and SIGTERM without a handler, end the process before
any exit hook runs.
"""

from __future__ import annotations

import atexit
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["close_at_exit"]


def close_at_exit(tel: Any) -> Callable[[], None]:
    """Run ``tel.close()`` at interpreter exit unless it is closed before; returns the hook (for
    ``atexit.unregister``)."""
    hook = functools.partial(_close_at_exit, weakref.ref(tel))
    atexit.register(hook)
    return hook


def _close_at_exit(ref: weakref.ref[Any]) -> None:
    tel = ref()
    if tel is None or tel._closed:
        return
    try:
        tel.close()
    except Exception as exc:  # an alarm's stop, a sink failing: the process is ending anyway
        warnings.warn(f"ampkit.Telemetry could not write its last records at exit: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=1)
