"""The framework service: which training frameworks the script drives and the precision it asked of them.

The framework watcher fills it as the script builds a framework's settings or driver object
(``TrainingArguments``, Lightning's ``Trainer``, ``Accelerator``); MIXED_PRECISION_OFF
(``script.mixed``) judges the requests against what ran, and the cast-site fixes spell autocast the
way the framework in use turns it on (``ampkit.findings.autocast_setting``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampkit.findings import autocast_setting

__all__ = ["FrameworkRequest", "Frameworks"]


@dataclass(frozen=True)
class FrameworkRequest:
    """One framework setting that asks for mixed precision."""

    setting: str
    """As the script spells it: ``TrainingArguments(fp16=True)``, ``Trainer(precision='16-mixed')``,
    ``Accelerator(mixed_precision='fp16')``, or where Accelerate read it from (environment, config file)."""
    dtype: str
    """``fp16`` or ``bf16``."""
    location: str | None
    """The user's ``file:line`` that built the object."""
    framework: str
    """``Trainer`` (Hugging Face), ``Lightning`` or ``Accelerate``."""
    reason: str = ""
    """Why the framework runs something else, when it decided so at construction ("" when it did not
    say: what ran is judged from the forwards)."""
    turn_on: str = ""
    """How to get what was asked for, with ``reason``."""

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "dtype": self.dtype, "location": self.location, "framework": self.framework}


class Frameworks:
    """The frameworks in use (first seen first) and their mixed-precision requests, in build order."""

    def __init__(self) -> None:
        self.requests: list[FrameworkRequest] = []
        self.used: list[str] = []
        """Framework names, as ``FrameworkRequest.framework``, whether or not precision was asked of them."""

    def use(self, framework: str) -> None:
        if framework not in self.used:
            self.used.append(framework)

    def add(self, request: FrameworkRequest) -> None:
        self.use(request.framework)
        self.requests.append(request)

    def autocast_setting(self) -> str:
        """How the script turns autocast on: the setting of the framework it drives first, else ``torch.autocast``."""
        return autocast_setting(self.used[0] if self.used else None)
