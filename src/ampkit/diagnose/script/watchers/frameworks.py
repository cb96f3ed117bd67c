"""The framework watcher: mixed precision asked for through a framework's settings object.

A Hugging Face ``TrainingArguments(fp16=True)`` (built by the script or by ``HfArgumentParser``
from ``--fp16``) asks for mixed precision that the Trainer silently drops on a CPU: Accelerate
enables fp16 autocast only on an accelerator, so the run trains in fp32.  The settings object
need not be a global of the script (it usually lives inside ``main()``), so its construction is
watched: ``TrainingArguments.__post_init__`` is wrapped once the script imports
``transformers.training_args`` (the doctor never imports transformers itself).  MIXED_PRECISION_OFF
(``script.mixed``) reads the requests.  Cost: one wrapper call per settings object built.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import WatchState
from ampkit.diagnose.script.watchers.base import Watcher

__all__ = ["FrameworkRequest", "FrameworkWatch"]


@dataclass(frozen=True)
class FrameworkRequest:
    """One settings object that asks for mixed precision."""

    setting: str
    """As the script spells it: ``TrainingArguments(fp16=True)``."""
    dtype: str
    """``fp16`` or ``bf16``."""
    location: str | None
    """The user's ``file:line`` that built it."""
    framework: str
    """``Trainer``."""

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "dtype": self.dtype, "location": self.location, "framework": self.framework}


class FrameworkWatch(Watcher):
    """The settings objects built by the script that ask for fp16/bf16 (``requests``, in build order)."""

    def __init__(self, state: WatchState) -> None:
        self.state = state
        self.requests: list[FrameworkRequest] = []
        self._patches: PatchSet | None = None

    @override
    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        patches.after_import("transformers.training_args", self._patch_training_args)

    def _patch_training_args(self, module: types.ModuleType) -> None:
        cls = getattr(module, "TrainingArguments", None)
        if not isinstance(cls, type) or "__post_init__" not in vars(cls) or self._patches is None:
            return
        self._patches.wrap(cls, "__post_init__", self._wrap_post_init)

    def _wrap_post_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __post_init__(args: Any, *a: Any, **kw: Any) -> None:
            orig(args, *a, **kw)
            if self.state.paused:
                return
            for field, dtype in (("fp16", "fp16"), ("bf16", "bf16")):
                if getattr(args, field, False) is True:
                    self.requests.append(FrameworkRequest(
                        setting=f"TrainingArguments({field}=True)", dtype=dtype, location=self.state.frames.caller(),
                        framework="Trainer"))
        return __post_init__
