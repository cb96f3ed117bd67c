"""The cast watcher: where the parameters of the script's modules became fp16/bf16.

LOW_PRECISION_PARAMS and DTYPE_MISMATCH name that place, so that the fix fits the cause: a
``model.half()`` to drop, a ``from_pretrained(dtype=torch.bfloat16)`` to load in fp32, or a
framework's precision setting that converted the model.  Watched:

* ``nn.Module.half`` / ``bfloat16`` / ``to`` / ``type``, wrapped on ``nn.Module`` (an override
  that calls ``super()``, as transformers' and Lightning's modules do, goes through it): each
  parameter whose dtype the call changed to fp16/bf16 gets a ``CastSite``;
* ``PreTrainedModel.from_pretrained`` once the script imports transformers (the doctor never
  imports it itself): the loaded model's fp16/bf16 parameters, with the ``dtype=`` /
  ``torch_dtype=`` that asked for them, or the checkpoint's own dtype that ``dtype="auto"`` keeps.

Cost: per call of these methods, one pass over the module's parameters before and one after
(set-up code, never the training step).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services.casts import CastSite
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding
from ampkit.precision import LOW_PRECISION_DTYPES

if TYPE_CHECKING:
    from ampkit.diagnose.script.models import ModelWatch

__all__ = ["CastWatch"]

_METHODS = ("half", "bfloat16", "to", "type")


class CastWatch(Watcher):
    """Records the ``CastSite`` of each parameter made fp16/bf16 (into ``CastSites``)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self._depth = 0
        self._patches: PatchSet | None = None

    @override
    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        for name in _METHODS:
            patches.wrap(nn.Module, name, self._wrap_cast)
        patches.after_import("transformers.modeling_utils", self._patch_transformers)

    def annotate(self, findings: list[Finding], models: ModelWatch) -> list[Finding]:
        """DTYPE_MISMATCH (the parameters of its module) and LOW_PRECISION_PARAMS (every model's) with
        the place their parameters became fp16/bf16 and the fix there, where that place is known and
        the finding does not name it yet."""
        if not findings or not len(self.state.casts):
            return findings
        by_name = {models.qualify(root, n): m for root in models.models() for n, m in root.named_modules()}
        out = []
        for f in findings:
            if f.code in ("DTYPE_MISMATCH", "LOW_PRECISION_PARAMS") and "made_low_precision" not in f.evidence:
                scope = by_name.get(f.module) if f.code == "DTYPE_MISMATCH" and f.module is not None else None
                params = scope.parameters() if scope is not None else (p for m in models.models() for p in m.parameters())
                site = self.state.casts.origin(params)
                if site is not None:
                    f = dataclasses.replace(f, message=f"{f.message}; {site.clause()}", fix=site.fix(self.state.frameworks.autocast_setting()),
                                            evidence={**f.evidence, "made_low_precision": site.evidence()})
            out.append(f)
        return out

    # -- nn.Module casts ---------------------------------------------------------------------
    def _wrap_cast(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        method = orig.__name__

        def cast(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self._depth or self.state.models.paused or torch.compiler.is_compiling():
                return orig(module, *args, **kwargs)
            params = list(module.parameters())
            before = {id(p): p.dtype for p in params}
            self._depth += 1
            try:
                out = orig(module, *args, **kwargs)
            finally:
                self._depth -= 1
            changed = [p for p in module.parameters() if p.dtype in LOW_PRECISION_DTYPES and before.get(id(p)) != p.dtype]
            if changed:
                dtype = changed[0].dtype
                by = _library_caller(sys._getframe(1), module, method, self.state.frames.is_user)
                site = CastSite(location=self.state.frames.caller(2), how=_spelled(method, dtype), dtype=dtype_name(dtype),
                                kind="framework" if by else "cast", by=by)
                self.state.casts.add(changed, site)
            return out
        return cast

    # -- transformers ------------------------------------------------------------------------
    def _patch_transformers(self, module: types.ModuleType) -> None:
        cls = getattr(module, "PreTrainedModel", None)
        raw = vars(cls).get("from_pretrained") if isinstance(cls, type) else None
        if not isinstance(raw, classmethod) or self._patches is None:
            return
        load = raw.__func__

        def from_pretrained(klass: type, *args: Any, **kwargs: Any) -> Any:
            if self._depth or self.state.models.paused:
                return load(klass, *args, **kwargs)
            self._depth += 1  # the casts inside loading are the load's, not the script's own
            try:
                out = load(klass, *args, **kwargs)
            finally:
                self._depth -= 1
            self._loaded(out[0] if isinstance(out, tuple) else out, kwargs)
            return out
        self._patches.replace(cls, "from_pretrained", classmethod(from_pretrained))

    def _loaded(self, model: Any, kwargs: dict[str, Any]) -> None:
        if not isinstance(model, nn.Module):
            return
        low = [p for p in model.parameters() if p.dtype in LOW_PRECISION_DTYPES]
        if not low:
            return
        name = "dtype" if kwargs.get("dtype") is not None else "torch_dtype"
        asked = kwargs.get(name)
        explicit = asked is not None and asked != "auto"
        spelled = f"torch.{str(asked).removeprefix('torch.')}" if isinstance(asked, torch.dtype) else repr(asked)
        site = CastSite(location=self.state.frames.caller(), dtype=dtype_name(low[0].dtype), kind="load",
                        how=f"from_pretrained({name}={spelled})" if explicit else "from_pretrained()",
                        explicit=explicit)
        self.state.casts.add(low, site)


def _spelled(method: str, dtype: torch.dtype) -> str:
    return f".{method}()" if method in ("half", "bfloat16") else f".{method}(torch.{str(dtype).removeprefix('torch.')})"


def _library_caller(frame: types.FrameType | None, module: nn.Module, method: str,
                    is_user: Callable[[str], bool]) -> str | None:
    """The top-level package of the library that called ``module.<method>``, or None when the script
    called it itself (an override of the method in the module's own class, such as transformers'
    ``PreTrainedModel.half``, is looked through)."""
    while frame is not None and not is_user(frame.f_code.co_filename):
        if frame.f_code.co_name == method and frame.f_locals.get("self") is module:
            frame = frame.f_back
            continue
        package = str(frame.f_globals.get("__name__", "")).split(".")[0]
        return package or None
    return None
