"""Distributed checkpoints: one file from rank 0 (DDP), or a DCP directory (FSDP2, and DDP).

Both layouts resume bit-identically: model, optimizer(s), scheduler(s), the engine (loss
scale, growth tracker, step counters) and **each rank's own RNG state** (Python, NumPy, torch,
CUDA), so per-rank dropout masks and data order continue exactly.

* ``save_ddp_checkpoint(path, ...)``: the RNG states are gathered to rank 0, which writes one
  file with ``ampkit.save_checkpoint`` (temp file, fsync, rename).  Every rank loads it.
* ``save_distributed_checkpoint(dir, ...)``: ``torch.distributed.checkpoint`` writes each rank's
  shards into ``.<dir>.partial`` next to the target; each rank adds ``rank<N>.pt`` (its RNG),
  rank 0 adds ``ampkit.pt`` (engine, scheduler and ``extra``: identical on every rank after the
  found_inf all-reduce, so stored once and checked to agree first), then renames the directory
  into place.  A crash at any point leaves the previous checkpoint loadable.

Every rank reports success or its error to the others after each phase, so a failure on one
rank (disk full, bad path) raises on all of them instead of leaving the rest in a barrier.

Checkpoints are saved at accumulation boundaries only: mid-window, DDP's local gradient sums
differ per rank and live in no state dict.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner

from ampkit._util.io import atomic_write_bytes, fsync_dir
from ampkit.checkpoint import (
    CheckpointError,
    as_list,
    capture_rng_state,
    check_extra,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from ampkit.distributed._comm import ProcessGroup, all_gather_bytes, require_process_group
from ampkit.distributed._setup import DistributedSetupError, check_consistent
from ampkit.engine import Engine

__all__ = [
    "load_ddp_checkpoint",
    "load_distributed_checkpoint",
    "save_ddp_checkpoint",
    "save_distributed_checkpoint",
]

DCP_FORMAT = "ampkit.dcp/1"
_META = "ampkit.pt"
_RANK_RNG_KEY = "ampkit.distributed.rank_rng"

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


# -- agreement between ranks ----------------------------------------------------------------------
class _Phase:
    """Run a phase on this rank and make every rank raise if any rank failed (one collective)."""

    def __init__(self, caller: str, what: str, group: ProcessGroup) -> None:
        self.caller, self.what, self.group = caller, what, group

    def __enter__(self) -> _Phase:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt/SystemExit: leave now, peers time out
        mine = b"" if exc is None else f"{type(exc).__name__}: {exc}".encode()
        reports = [r.decode(errors="replace") for r in all_gather_bytes(mine, self.group)]
        failed = {rank: msg for rank, msg in enumerate(reports) if msg}
        if not failed:
            return False
        if exc is not None and isinstance(exc, (CheckpointError, DistributedSetupError)) and len(failed) == len(reports):
            return False  # the same error everywhere: raise it as is
        detail = "\n".join(f"  rank {rank}: {msg}" for rank, msg in failed.items())
        raise CheckpointError(f"{self.caller}: {self.what} failed on {len(failed)} rank(s):\n{detail}") from exc


def _check_boundary(engine: Engine | None, caller: str) -> None:
    if engine is not None and engine.micro_step:
        raise CheckpointError(
            f"{caller}: the engine is {engine.micro_step} micro-batches into a {engine.grad_accumulation}-step "
            "accumulation window; each rank's partial gradient sum is local and is in no state dict. "
            "Save right after mp.step() returns a boundary result (result.boundary is True)"
        )


def _check_engines_agree(engine: Engine | None, group: ProcessGroup, caller: str) -> None:
    if engine is None:
        return
    check_consistent(
        engine.state_dict(),
        group,
        caller=caller,
        fix="the ranks' loss scalers or step counters diverged, so there is no single engine state to save; "
        "call ampkit.distributed.setup(mp) on every rank before training so that every rank takes the "
        "same skip decision and the same scale update",
    )


def _rng_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(capture_rng_state(), buf)
    return buf.getvalue()


def _restore_rng_bytes(data: bytes) -> None:
    restore_rng_state(torch.load(io.BytesIO(data), weights_only=True))


def _param_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


# -- DDP: one file written by rank 0 --------------------------------------------------------------
def save_ddp_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizers = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    process_group: ProcessGroup = None,
) -> Path:
    """Save a replicated (DDP) run: rank 0 writes ``path`` atomically with every rank's RNG state.

    Every rank must call it.  Returns after the file exists (every rank waits for rank 0).
    Load it with ``load_ddp_checkpoint`` on the same number of ranks.
    """
    caller = "ampkit.distributed.save_ddp_checkpoint"
    require_process_group(caller)
    _check_boundary(engine, caller)
    _check_engines_agree(engine, process_group, caller)
    states = all_gather_bytes(_rng_bytes(), process_group)
    target = Path(path)
    with _Phase(caller, f"writing {str(target)!r}", process_group):
        if dist.get_rank(process_group) == 0:
            payload = dict(extra or {})
            if _RANK_RNG_KEY in payload:
                raise ValueError(f"extra[{_RANK_RNG_KEY!r}] is reserved for the per-rank RNG states; rename it")
            payload[_RANK_RNG_KEY] = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in states]
            save_checkpoint(target, model=model, optimizer=optimizer, engine=engine, scheduler=scheduler, extra=payload)
    return target


def load_ddp_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizers = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    process_group: ProcessGroup = None,
) -> dict[str, Any]:
    """Load a ``save_ddp_checkpoint`` file on every rank; returns the user's ``extra`` dict.

    Tensors are mapped to the device of ``model``'s parameters (not rank 0's device).  With
    ``restore_rng`` each rank gets back its own RNG state, which needs the same world size.
    """
    caller = "ampkit.distributed.load_ddp_checkpoint"
    require_process_group(caller)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    with _Phase(caller, f"loading {str(path)!r}", process_group):
        extra = load_checkpoint(
            path, model=model, optimizer=optimizer, engine=engine, scheduler=scheduler,
            map_location=_param_device(model), restore_rng=False,
        )
        states = extra.pop(_RANK_RNG_KEY, None)
        if restore_rng:
            if states is None:
                raise CheckpointError(
                    f"{str(path)!r} holds no per-rank RNG states (it was written by ampkit.save_checkpoint, not "
                    "save_ddp_checkpoint); pass restore_rng=False to load it without them"
                )
            if len(states) != world:
                raise CheckpointError(
                    f"{str(path)!r} holds the RNG states of {len(states)} ranks but {world} are loading it; "
                    "resume on the same number of ranks, or pass restore_rng=False (random streams then restart)"
                )
            _restore_rng_bytes(states[rank].numpy().tobytes())
    return extra


# -- DCP: a directory of shards --------------------------------------------------------------------
def _swap_in(tmp: Path, target: Path) -> None:
    # os.rename cannot replace a non-empty directory: move the old one aside first.  A crash
    # between the two renames leaves both complete directories (the message of
    # load_distributed_checkpoint names them).
    old = target.parent / f".{target.name}.old"
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _state(model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if opts:
        state["optimizer"] = get_optimizer_state_dict(model, opts)
    return state


def save_distributed_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizers = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    process_group: ProcessGroup = None,
) -> Path:
    """Save a sharded (FSDP2) or replicated (DDP) run with ``torch.distributed.checkpoint``.

    Every rank must call it; the directory should be on storage every rank can reach.  The
    write goes to ``.<name>.partial`` and is renamed to ``directory`` when every rank is done,
    replacing an existing checkpoint there.  Returns the directory.
    """
    caller = "ampkit.distributed.save_distributed_checkpoint"
    require_process_group(caller)
    _check_boundary(engine, caller)
    _check_engines_agree(engine, process_group, caller)
    opts, scheds = as_list(optimizer), as_list(scheduler)
    meta: dict[str, Any] = {
        "format": DCP_FORMAT,
        "world_size": dist.get_world_size(process_group),
        "optimizers": len(opts),
        "engine": engine.state_dict() if engine is not None else None,
        "scheduler": [s.state_dict() for s in scheds],
        "extra": dict(extra or {}),
    }
    rank = dist.get_rank(process_group)
    target = Path(directory)
    tmp = target.parent / f".{target.name}.partial"
    with _Phase(caller, f"preparing {str(tmp)!r}", process_group):
        check_extra(meta["extra"])
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that crashed
            tmp.mkdir(parents=True)
    with _Phase(caller, f"writing shards to {str(tmp)!r}", process_group):
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        dcp.save(_state(model, opts), storage_writer=writer, process_group=process_group)
        atomic_write_bytes(tmp / f"rank{rank}.pt", _rng_bytes())
    with _Phase(caller, f"publishing {str(target)!r}", process_group):
        if rank == 0:
            buf = io.BytesIO()
            torch.save(meta, buf)
            atomic_write_bytes(tmp / _META, buf.getvalue())
            _swap_in(tmp, target)
    return target


def load_distributed_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Optimizers = None,
    engine: Engine | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    process_group: ProcessGroup = None,
) -> dict[str, Any]:
    """Load a ``save_distributed_checkpoint`` directory in place on every rank; returns ``extra``.

    Shards are resharded to the current layout by DCP.  Nothing is unpickled beyond plain data:
    DCP's metadata is checked against an allow-list of its own classes, and its non-tensor
    items must load with ``weights_only=True``.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    caller = "ampkit.distributed.load_distributed_checkpoint"
    require_process_group(caller)
    target = Path(directory)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    opts, scheds = as_list(optimizer), as_list(scheduler)
    with _Phase(caller, f"reading {str(target)!r}", process_group):
        meta = _read_meta(target)
        if opts and len(opts) != meta["optimizers"]:
            raise CheckpointError(
                f"{str(target)!r} holds the state of {meta['optimizers']} optimizer(s) but {len(opts)} were passed"
            )
        if scheds and len(scheds) != len(meta["scheduler"]):
            raise CheckpointError(
                f"{str(target)!r} holds {len(meta['scheduler'])} scheduler state(s) but {len(scheds)} were passed"
            )
        if engine is not None and meta["engine"] is None:
            raise CheckpointError(
                f"{str(target)!r} has no engine state (saved without engine=...), so the loss scale cannot be "
                "restored (ampkit finding CHECKPOINT_MISSING_SCALER); save with engine=mp"
            )
        if restore_rng and meta["world_size"] != world:
            raise CheckpointError(
                f"{str(target)!r} was saved by {meta['world_size']} ranks and {world} are loading it: the shards "
                "reshard fine, but the per-rank RNG states do not map; pass restore_rng=False"
            )
        _check_metadata(target / ".metadata")
    with _Phase(caller, f"loading shards from {str(target)!r}", process_group):
        state = _state(model, opts)
        dcp.load(state, storage_reader=dcp.FileSystemReader(target), planner=_WeightsOnlyLoadPlanner(),
                 process_group=process_group)
        set_model_state_dict(model, state["model"])
        if opts:
            set_optimizer_state_dict(model, opts, state["optimizer"])
        if engine is not None:
            engine.load_state_dict(meta["engine"])
        for s, sd in zip(scheds, meta["scheduler"]):
            s.load_state_dict(sd)
        if restore_rng:
            _restore_rng_bytes((target / f"rank{rank}.pt").read_bytes())
    return dict(meta["extra"])


def _read_meta(target: Path) -> dict[str, Any]:
    path = target / _META
    if not path.exists():
        leftovers = [p.name for p in (target.parent / f".{target.name}.partial", target.parent / f".{target.name}.old")
                     if p.exists()]
        hint = (f" The parent directory holds {leftovers}: a save was interrupted; {leftovers[-1]!r} is the last "
                "complete checkpoint if it has an ampkit.pt") if leftovers else ""
        raise CheckpointError(
            f"{str(target)!r} is not a complete ampkit distributed checkpoint (no {_META}).{hint}"
        )
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as exc:
        raise CheckpointError(f"{str(path)!r} is corrupted and cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != DCP_FORMAT:
        raise CheckpointError(f"{str(path)!r} is not an {DCP_FORMAT} file")
    return meta


# -- loading DCP without arbitrary unpickling ---------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Decide before importing anything: an import can run code of its own.
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULES):
            obj = super().find_class(module, name)
            # DCP's metadata is dataclasses and enums of torch.distributed.checkpoint: data, no code.
            if isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, Enum)):
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def _check_metadata(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{str(path)!r} is missing: the DCP shards are incomplete") from exc
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{str(path)!r} refused: {exc}; only DCP's own metadata classes load") from exc


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items must pass ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)
