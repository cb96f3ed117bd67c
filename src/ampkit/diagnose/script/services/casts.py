"""The cast-site service: where each parameter made fp16/bf16 became so (``CastSite``).

The cast watcher records the sites (``nn.Module.half`` / ``to`` / ..., ``from_pretrained``); the
optimizer watcher reads them into LOW_PRECISION_PARAMS, the cast watcher into DTYPE_MISMATCH.
Parameters are held weakly: a dropped model is forgotten.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["CastSite", "CastSites"]


@dataclass(frozen=True)
class CastSite:
    """Where some parameters became fp16/bf16."""

    location: str | None
    """The user's ``file:line`` of the call."""
    how: str
    """The call, as code: ``.half()``, ``.to(torch.bfloat16)``, ``from_pretrained(dtype=torch.bfloat16)``."""
    dtype: str
    """``fp16`` or ``bf16``."""
    kind: str
    """``cast`` (the script's own call), ``framework`` (a library converted the model during the
    script's call) or ``load`` (``from_pretrained``)."""
    by: str | None = None
    """The library that made the call (``lightning``), for ``framework``."""
    explicit: bool = True
    """For ``load``: the dtype was asked for (False: the checkpoint's own, kept by ``dtype="auto"``)."""

    def evidence(self) -> dict[str, Any]:
        """The findings' ``evidence["made_low_precision"]``."""
        return {"location": self.location, "call": self.how, "dtype": self.dtype, "kind": self.kind}

    @property
    def _at(self) -> str:
        return f" at {self.location}" if self.location else ""

    def clause(self) -> str:
        """Where the parameters became low precision, as a sentence fragment."""
        if self.kind == "framework":
            return f"{self.by} converted them to {self.dtype} with `{self.how}` during the call{self._at}"
        if self.kind == "load" and not self.explicit:
            return (f"`from_pretrained`{self._at} loaded them in {self.dtype}: with no dtype= argument transformers "
                    "keeps the checkpoint's dtype (dtype='auto')")
        return f"they became {self.dtype} through `{self.how}`{self._at}"

    def fix(self, autocast: str = "torch.autocast") -> str:
        """What to change there; autocast then casts per op.  ``autocast``: how the script turns it on
        (``Frameworks.autocast_setting()``: the setting of the framework it drives)."""
        then = f"and let autocast ({autocast}) cast them per op"
        if self.kind == "load":
            if self.explicit:
                arg = self.how.removeprefix("from_pretrained(").removesuffix(")")
                return f"load in fp32: drop {arg} from from_pretrained{self._at} (or pass dtype=torch.float32), {then}"
            return f"load in fp32: pass dtype=torch.float32 to from_pretrained{self._at}, {then}"
        if self.kind == "framework":
            return (f"choose a {self.by} precision that keeps fp32 weights and autocasts per op{self._at} (a '-mixed' "
                    "one such as precision='bf16-mixed', not '-true')")
        return f"keep the parameters in fp32: drop `{self.how}`{self._at}, {then}"


class CastSites:
    """The ``CastSite`` of each parameter made fp16/bf16 (weakly held)."""

    def __init__(self) -> None:
        self._sites: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __len__(self) -> int:
        return len(self._sites)

    def add(self, params: Iterable[torch.Tensor], site: CastSite) -> None:
        """``params`` became fp16/bf16 at ``site`` (a later site of a parameter replaces an earlier one)."""
        for p in params:
            self._sites[p] = site

    def origin(self, params: Iterable[torch.Tensor]) -> CastSite | None:
        """The site where most of ``params`` that are still fp16/bf16 became so; None when unknown."""
        sites: Counter[CastSite] = Counter()
        for p in params:
            if p.dtype in LOW_PRECISION_DTYPES:
                site = self._sites.get(p)
                if site is not None:
                    sites[site] += 1
        return sites.most_common(1)[0][0] if sites else None
