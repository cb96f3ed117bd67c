"""A tiny GPT-2 and Trainer for the integration tests (built from a config: nothing is downloaded)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

try:
    from tests.telemetry.telemetry_helpers import FORBIDDEN
except ImportError:  # run by torchrun with this folder on the path
    FORBIDDEN = ()

CONFIG = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}


def data(n: int = 24, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, CONFIG["vocab_size"], (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def tiny_gpt2(dtype: torch.dtype = torch.float32) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype)


def trainer(out: Path, *, callbacks: list[Any] = (), steps: int = 3, accum: int = 1, model: Any = None,
            **kw: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(out), use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accum, disable_tqdm=True, seed=0, data_seed=0,
                             **{"save_strategy": "no", "logging_strategy": "no", **kw})
    return Trainer(model=model if model is not None else tiny_gpt2(), args=args, train_dataset=data(),
                   callbacks=list(callbacks))


def nan_at_call(model: Any, call: int) -> Callable[[], None]:
    """Make the final layer norm's output NaN on the ``call``-th training forward; returns the remover."""
    calls = [0]

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        calls[0] += 1
        return output * float("nan") if calls[0] == call else None

    return model.transformer.ln_f.register_forward_hook(hook).remove


def _caller(frame: FrameType | None) -> str | None:
    """"flush" inside a telemetry flush, "hook" inside other ampkit telemetry / integration code, else None."""
    inside = False
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/ampkit/telemetry/" in name or "/ampkit/integrations/" in name:
            if frame.f_code.co_name == "flush":
                return "flush"
            inside = True
        frame = frame.f_back
    return "hook" if inside else None


def forbid_sync_in_ampkit(monkeypatch: pytest.MonkeyPatch, flush_reads: list[str]) -> None:
    """The sync methods raise inside ampkit's hooks and callbacks; the framework itself may still sync."""
    for name in FORBIDDEN:
        original: Callable[..., Any] = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *args: Any, _name: str = name, _orig: Callable[..., Any] = original,
                    **kwargs: Any) -> Any:
            where = _caller(sys._getframe(1))
            if where == "hook":
                raise AssertionError(f"Tensor.{_name} was called in an ampkit hook")
            if where == "flush":
                flush_reads.append(_name)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
