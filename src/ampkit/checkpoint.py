"""Atomic, safe checkpoints that resume bit-identically.

A checkpoint holds the model, optimizer(s), scheduler, the engine (loss-scaler state and the
accumulation position, plus the gradients accumulated so far when saved mid-window), every RNG
state (python, numpy, torch CPU and accelerators) and the caller's ``extra`` dict.

Writes go to a temporary file in the same directory, are fsync'ed, then renamed over the
target, so a crash or ``kill -9`` leaves either the old checkpoint or the new one, never half
of one.  Loads use ``torch.load(weights_only=True)``: no pickled code ever runs.
"""

from __future__ import annotations

import os
import pickle
import random
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ampkit._util.io import atomic_replace
from ampkit.engine import Engine

__all__ = [
    "CheckpointError",
    "as_list",
    "capture_rng_state",
    "check_extra",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

FORMAT = "ampkit.checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit what it is loaded into."""


def as_list(obj: Any) -> list[Any]:
    """``obj`` as a list: None is empty, a list or tuple is copied, anything else is wrapped."""
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state of this process (python, numpy, torch CPU, CUDA) in ``weights_only`` form."""
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states ``capture_rng_state`` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save everything needed to resume bit-identically; returns the path.

    ``extra`` must hold only tensors, numbers, strings, lists, tuples and dicts (what
    ``weights_only`` loading accepts).  The engine state is read back from the device: one host
    sync per save.
    """
    payload: dict[str, Any] = {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": [o.state_dict() for o in as_list(optimizer)],
        "scheduler": [s.state_dict() for s in as_list(scheduler)],
        "engine": engine.state_dict() if engine is not None else None,
        "rng": capture_rng_state(),
        "extra": dict(extra or {}),
    }
    if engine is not None and engine.micro_step:
        # Mid-window: the partial sums live in .grad, which no state_dict holds.
        payload["grads"] = _named_grads(model)
    check_extra(payload["extra"])
    target = Path(path)
    atomic_replace(target, lambda f: torch.save(payload, f))
    return target


def check_extra(extra: dict[str, Any]) -> None:
    """Raise ``TypeError`` naming the first value of ``extra`` that ``weights_only`` loading rejects."""
    allowed = (torch.Tensor, int, float, str, bool, type(None), bytes)

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
        elif not isinstance(value, allowed):
            raise TypeError(
                f"save_checkpoint(extra=...): {where} is a {type(value).__name__}; checkpoints load with "
                "weights_only=True, which accepts only tensors, numbers, strings, lists, tuples and dicts. "
                "Convert it (e.g. numpy arrays with torch.from_numpy) before saving"
            )

    walk(extra, "extra")


# Every file torch.save writes (and so every ampkit checkpoint) is a zip archive: it starts with a
# zip local-file header.  A truncated checkpoint still does; a text file or a legacy pickle does not.
_ZIP_MAGIC = b"PK\x03\x04"


def _head(path: Path) -> bytes:
    """The first bytes of ``path``, or ``CheckpointError`` when it is missing or not a readable file."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist") from None
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a directory, not a file; pass the file save_checkpoint wrote "
            "(a directory written by save_distributed_checkpoint loads with load_distributed_checkpoint)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a regular file; pass the file save_checkpoint wrote")
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({exc.strerror or exc})") from exc


def _refused_object(exc: pickle.UnpicklingError) -> str | None:
    """What torch's weights_only unpickler refused, or None when the error is not a refusal."""
    text = str(exc)
    if not text.startswith("Weights only load failed"):
        return None
    # The first paragraph is torch's advice to retry with weights_only=False: exactly what must
    # not be done with a file that holds code.  Keep only the line that names the object.
    lines = [line.strip() for line in text.split("\n\n")[1:] if line.strip()]
    detail = next((line for line in lines if "weights_only" not in line), "")
    return detail.splitlines()[0] if detail else "an object outside tensors, numbers, strings and containers"


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    head = _head(path)
    if not head.startswith(_ZIP_MAGIC):
        what = "it is empty" if not head else f"it starts with {head!r}, not with the zip header torch.save writes"
        raise CheckpointError(
            f"{str(path)!r} is not an ampkit checkpoint ({what}); pass a file written by ampkit.save_checkpoint"
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_object(exc)
        if refused is None:
            raise _corrupted(path, exc) from exc
        # from None: the chained torch error would print its weights_only=False advice again.
        raise CheckpointError(
            f"checkpoint {str(path)!r} contains objects that are not allowed; refusing to execute them "
            f"({refused}). A checkpoint holds only tensors, numbers, strings and containers; this file "
            "was not written by ampkit.save_checkpoint, or was altered since; treat it as untrusted"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError) as exc:
        raise _corrupted(path, exc) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not an ampkit checkpoint (format {payload.get('format') if isinstance(payload, dict) else None!r}, "
            f"expected {FORMAT!r}); load it with torch.load(..., weights_only=True) yourself"
        )
    return payload


def _corrupted(path: Path, exc: BaseException) -> CheckpointError:
    size = path.stat().st_size
    first = str(exc).splitlines()[0] if str(exc) else ""
    return CheckpointError(
        f"checkpoint {str(path)!r} ({size} bytes) is corrupted or truncated and cannot be loaded "
        f"({type(exc).__name__}: {first}). It was not modified; resume from an earlier checkpoint"
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    map_location: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint in place and return its ``extra`` dict.

    Raises ``CheckpointError`` for a missing, corrupted or truncated file, or when the number of
    optimizers/schedulers or the engine state does not fit what is passed in.
    """
    p = Path(path)
    payload = _read(p, map_location)
    opts, scheds = as_list(optimizer), as_list(scheduler)
    for label, given, saved in (("optimizer", opts, payload["optimizer"]), ("scheduler", scheds, payload["scheduler"])):
        if given and len(given) != len(saved):
            raise CheckpointError(
                f"{str(p)!r} holds {len(saved)} {label} state(s) but {len(given)} were passed to load_checkpoint"
            )
    if engine is not None and payload.get("engine") is None:
        raise CheckpointError(
            f"{str(p)!r} has no engine state (saved without engine=...), so the loss scale and the "
            "accumulation position cannot be restored (ampkit finding CHECKPOINT_MISSING_SCALER); "
            "save with save_checkpoint(..., engine=mp)"
        )
    model.load_state_dict(payload["model"])
    for o, sd in zip(opts, payload["optimizer"]):
        o.load_state_dict(sd)
    for s, sd in zip(scheds, payload["scheduler"]):
        s.load_state_dict(sd)
    if engine is not None:
        engine.load_state_dict(payload["engine"])
    grads = payload.get("grads")
    if grads:
        for name, param in model.named_parameters():
            if name in grads:
                param.grad = grads[name].to(param.device)
    if restore_rng:
        restore_rng_state(payload["rng"])
    return dict(payload["extra"])
