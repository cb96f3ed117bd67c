"""The autocast watcher: ``torch.autocast`` regions (the scope of autocast's weight-cast cache)
and STALE_WEIGHT_CACHE, a forward inside a region in which an optimizer already stepped.

Each wrapper does a little Python bookkeeping and calls the original."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from ampkit._util.dtypes import dtype_name
from ampkit._util.weakmap import WeakIdentityMap
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding

_DECORATOR_FILE = torch.amp.autocast_mode.__file__
"""Where ``@torch.autocast(...)`` enters its instance (``autocast_decorator``)."""

if TYPE_CHECKING:
    from ampkit.diagnose.capture import Capture

__all__ = ["AutocastRequest", "AutocastWatch"]

@dataclass
class AutocastRequest:
    device_type: str
    dtype: torch.dtype
    requested: bool
    effective: bool
    location: str | None
    entered: int = 0


@dataclass
class _Made:
    """One autocast object's ``enabled=`` (None: built before the doctor or while paused), its line, and whether
    its last entry was while the doctor ran a model itself (its exit then closes no region)."""

    requested: bool | None = None
    location: str | None = None
    paused: bool = False


class AutocastWatch(Watcher):
    """Autocast objects built and entered, and the regions they open (``AutocastRegions``: outermost
    ``with`` blocks, the scope of autocast's weight-cast cache)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        # torch's autocast objects, held weakly; nothing is written on them.  Cost: about 3 µs per autocast block
        # built and entered (an entry per object, a lookup per enter and per exit) over attributes on the object.
        self._made: WeakIdentityMap[Any, _Made] = WeakIdentityMap()
        self.requests: dict[tuple[str | None, str, torch.dtype], AutocastRequest] = {}
        """Autocast objects entered, by (line, device type, dtype)."""
        self.built: dict[tuple[str | None, str, torch.dtype], AutocastRequest] = {}
        """Autocast objects built, entered or not (``entered`` stays 0 here; see ``requests``)."""

    @override
    def install(self, patches: PatchSet) -> None:
        cls = torch.amp.autocast_mode.autocast
        patches.wrap(cls, "__init__", self._wrap_init)
        patches.wrap(cls, "__enter__", self._wrap_enter)
        patches.wrap(cls, "__exit__", self._wrap_exit)

    def _wrap_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        code = self.state.frames

        def __init__(ac: Any, *args: Any, **kwargs: Any) -> None:
            device = kwargs.get("device_type", args[0] if args else None)
            if device == "cuda" and not torch.cuda.is_available():
                code.call(orig, ac, *args, **kwargs)  # torch warns: keep the warning on the user's line
            else:
                orig(ac, *args, **kwargs)
            if self.state.models.paused:
                return
            requested = kwargs.get("enabled", args[2] if len(args) > 2 else True)
            loc = code.caller()
            self._made[ac] = _Made(bool(requested), loc)
            key = (loc, str(ac.device), ac.fast_dtype)
            if key not in self.built:
                self.built[key] = AutocastRequest(device_type=str(ac.device), dtype=ac.fast_dtype,
                                                  requested=bool(requested), effective=bool(ac._enabled), location=loc)
        return __init__

    def _wrap_enter(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def __enter__(ac: Any) -> Any:
            out = orig(ac)
            made = self._made.get(ac)
            if made is None:
                made = self._made[ac] = _Made()
            # per entry: a decorator's instance is entered again after a replay that ran it paused
            made.paused = paused = self.state.models.paused
            if paused:
                return out
            loc = made.location
            self.state.regions.enter(loc, enabled=bool(ac._enabled))
            key = (loc, str(ac.device), ac.fast_dtype)
            req = self.requests.get(key)
            if req is None:
                req = self.requests[key] = AutocastRequest(
                    device_type=str(ac.device), dtype=ac.fast_dtype,
                    requested=bool(ac._enabled) if made.requested is None else made.requested,
                    effective=bool(ac._enabled), location=loc,
                )
            req.entered += 1
            if ac._enabled:
                self._note_framework_entry(ac)
            return out
        return __enter__

    def _wrap_exit(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def __exit__(ac: Any, *exc: Any) -> Any:
            try:
                return orig(ac, *exc)
            finally:
                made = self._made.get(ac)
                if made is None or not made.paused:
                    self.state.regions.exit()
        return __exit__

    def _note_framework_entry(self, ac: Any) -> None:
        """An autocast entered by framework code (not a line of the script) inside a model's forward
        is the precision that forward ran in; one frame lookup per enabled entry."""
        frame = sys._getframe(2)
        name = frame.f_code.co_filename
        if self.state.frames.is_user(name) or name == __file__:
            return
        marker = ac if name == _DECORATOR_FILE else (name, frame.f_lineno)
        self.state.models.on_autocast_enter(str(ac.device), ac.fast_dtype, marker)

    @override
    def on_root_forward(self, cap: Capture) -> None:
        """STALE_WEIGHT_CACHE: a forward inside the region in which an optimizer already stepped."""
        regions = self.state.regions
        if regions.region_stepped is None or not cap.autocast_enabled or not torch.is_autocast_cache_enabled():
            return
        self.state.ledger.add(Finding(
            code="STALE_WEIGHT_CACHE", severity="error",
            message=(
                f"the optimizer stepped at {regions.region_stepped} inside the autocast region opened at "
                f"{regions.region_location}, and the model ran forward again in the same region: autocast "
                f"caches the {dtype_name(cap.autocast_dtype)} copy of each weight for the whole region, so "
                "this forward used the weights from before the update"
            ),
            fix=(
                "open the autocast region per step, around the forward and the loss only: "
                "`with torch.autocast(...): loss = ...` then backward, optimizer step and zero_grad outside it"
            ),
            location=self.state.frames.caller(), step=self.state.step,
            evidence={"region_opened_at": regions.region_location, "optimizer_step_at": regions.region_stepped},
        ), key=regions.region_location)
