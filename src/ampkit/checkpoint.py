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
    missing = [key for key in _REQUIRED if key not in payload]
    if missing:
        raise CheckpointError(f"{str(path)!r} is an ampkit checkpoint without its {', '.join(map(repr, missing))} "
                              "entries (save_checkpoint always writes them): it was altered or written by other code; "
                              "nothing was loaded")
    return payload


_REQUIRED = ("model", "optimizer", "scheduler", "rng", "extra")
"""The entries every save_checkpoint writes; ``engine`` may be None, ``grads`` exists mid-window only."""


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

    Raises ``CheckpointError`` for a missing, corrupted or truncated file, or when a part does not
    fit what is passed in: parameter names and shapes, the optimizers' parameter groups and state
    shapes, the schedulers, the engine's precision and accumulation position.  All of that is
    checked before anything is modified, so after the error every object is as it was.
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
    # Every part is checked against its target before the first one is written, so a checkpoint
    # that does not fit leaves model, optimizer, scheduler and engine exactly as they were.
    _check_fits(str(p), payload, model, opts, scheds, engine)
    if restore_rng:
        _check_rng(str(p), payload["rng"])
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


# Optimizer state entries that torch.optim keeps shaped like their parameter.  Other entries
# (Adafactor's factored row_var/col_var, LBFGS's flat vectors, a custom optimizer's) are compared
# only with the target optimizer's own state, when it already has one.
_PARAM_SHAPED = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "grad_avg",
    "sum", "ax", "prev", "step_size", "exp_inf", "variance",
})


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_fits(where: str, payload: dict[str, Any], model: nn.Module, opts: list[Any], scheds: list[Any],
                engine: Engine | None) -> None:
    """Raise ``CheckpointError`` when a part of ``payload`` does not fit its target; modifies nothing."""
    target = model.state_dict()
    _check_tensors(where, "model", payload["model"], target, "build the model with the same architecture")
    params = dict(model.named_parameters())
    _check_tensors(where, "accumulated gradients", payload.get("grads") or {}, params, "", subset=True)
    for i, (o, sd) in enumerate(zip(opts, payload["optimizer"])):
        _check_optimizer(f"{where}: optimizer[{i}] ({type(o).__name__})", o, sd)
    for i, (s, sd) in enumerate(zip(scheds, payload["scheduler"])):
        _check_scheduler(f"{where}: scheduler[{i}] ({type(s).__name__})", s, sd)
    if not isinstance(payload["extra"], dict):
        raise CheckpointError(f"{where}: the extra entry is a {type(payload['extra']).__name__}, not a dict")
    if engine is not None:
        try:
            engine.check_state_dict(payload["engine"])
        except (ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{where}: the engine state does not fit: {exc}") from exc


def _check_rng(where: str, saved: Any) -> None:
    """Try the saved RNG states for real and put the current ones back: a malformed one raises here,
    before the model is touched, with the error that restoring it would give."""
    current = capture_rng_state()
    try:
        restore_rng_state(saved)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the saved RNG state cannot be restored ({type(exc).__name__}: {exc}); nothing "
                              "was loaded. Pass restore_rng=False to resume without it (the run will not be "
                              "bit-identical)") from None
    finally:
        restore_rng_state(current)


def _check_tensors(where: str, label: str, saved: Any, target: dict[str, Any], fix: str, subset: bool = False) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: the {label} entry is a {type(saved).__name__}, not a state dict")
    missing = [] if subset else [k for k in target if k not in saved]
    unexpected = [k for k in saved if k not in target]
    shapes = [f"{k}: saved {_shape(v)}, here {_shape(target[k])}" for k, v in saved.items()
              if k in target and isinstance(v, torch.Tensor) and isinstance(target[k], torch.Tensor)
              and v.shape != target[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{name} {items[:5]}{' ...' if len(items) > 5 else ''}"
                 for name, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                 if items]
        raise CheckpointError(f"{where}: the {label} does not fit ({'; '.join(parts)}); nothing was loaded. "
                              + (fix or "load it into the model it was saved from"))


def _check_optimizer(where: str, opt: Any, saved: Any) -> None:
    if not (isinstance(saved, dict) and isinstance(saved.get("param_groups"), list) and "state" in saved):
        raise CheckpointError(f"{where}: the saved entry is not an optimizer state_dict() (needs 'state' and "
                              "'param_groups')")
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != saved_sizes:
        raise CheckpointError(
            f"{where}: the saved optimizer has {len(saved_sizes)} parameter group(s) of sizes {saved_sizes}, this "
            f"one {len(sizes)} of sizes {sizes}; nothing was loaded. Build the optimizer over the same parameters, "
            "in the same groups and order, as the run that saved it"
        )
    # torch maps the saved parameter ids to this optimizer's parameters in group order.
    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = dict(zip((i for g in saved["param_groups"] for i in g["params"]), params))
    bad = []
    for pid, entry in saved["state"].items():
        p = by_id.get(pid)
        if p is None or not isinstance(entry, dict):
            continue
        own = opt.state.get(p, {})
        step = entry.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float, torch.Tensor))):
            bad.append(f"parameter {pid} step: a {type(step).__name__}, not a number")
        for key, v in entry.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            expected = own[key] if isinstance(own.get(key), torch.Tensor) else (p if key in _PARAM_SHAPED else None)
            if expected is not None and v.shape != expected.shape:
                bad.append(f"parameter {pid} {key}: saved {_shape(v)}, here {_shape(expected)}")
    if bad:
        raise CheckpointError(f"{where}: the optimizer state does not fit the parameters ({'; '.join(bad[:5])}); "
                              "nothing was loaded. Build the optimizer over the same parameters in the same order")


def _check_scheduler(where: str, sched: Any, saved: Any) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: the saved entry is a {type(saved).__name__}, not a scheduler state_dict()")
    target = sched.state_dict()
    # Private keys and 'verbose' come and go between torch versions; the public settings name the kind.
    missing = [k for k in target if not k.startswith("_") and k != "verbose" and k not in saved]
    if missing:
        raise CheckpointError(f"{where}: the saved state lacks {missing}, so it comes from another kind of scheduler "
                              f"(saved keys {sorted(saved)}); nothing was loaded. Build the same scheduler as the "
                              "run that saved it")
    base, saved_base = target.get("base_lrs"), saved.get("base_lrs")
    if isinstance(base, list) and isinstance(saved_base, list) and len(base) != len(saved_base):
        raise CheckpointError(f"{where}: the saved scheduler drives {len(saved_base)} parameter group(s), this one "
                              f"{len(base)}; nothing was loaded. Build it over an optimizer with the same groups")
