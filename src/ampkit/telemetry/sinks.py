"""Sinks: where flushed step records go.  JSONL, TensorBoard, a rich progress bar, a callback.

A sink receives the records of one flush at a time (``write``), every alarm event
(``alarm``), and ``close`` once.  Sinks run on the host after the flush's single sync, so
they cost no device time.  ``Telemetry`` guards every call: a sink that raises (a full disk,
a closed file, a dead network mount) is reported once as a ``SinkFailedWarning`` and
disabled; training goes on.

>>> seen = []
>>> sink = CallbackSink(seen.append)
>>> sink.write([{"step": 1, "loss": 2.0}])
>>> seen
[{'step': 1, 'loss': 2.0}]
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ampkit._util.io import append_whole
from ampkit._util.jsonfloat import NONFINITE_AS_TOKEN, dumps

__all__ = ["CallbackSink", "JsonlSink", "ProgressSink", "Sink", "SinkFailedWarning", "TensorBoardSink", "as_sink"]

Record = dict[str, Any]

# Scalars each step record contributes to TensorBoard / the progress bar.
SCALAR_KEYS = ("loss", "scale", "grad_norm", "clip_coef", "nonfinite_grads", "zero_grad_fraction", "lr")


class SinkFailedWarning(RuntimeWarning):
    """A telemetry sink raised; it has been disabled and training continues."""


class Sink:
    """Base sink: every method is a no-op.  Subclass and override what you need."""

    rank_zero_only: bool = False
    """Whether only rank 0 writes (set by sinks that share one output between ranks)."""

    def write(self, records: Sequence[Record]) -> None:
        """Called with the records of one flush, in step order."""

    def alarm(self, event: Record) -> None:
        """Called with ``AlarmEvent.to_dict()`` for every alarm that fired in the flush."""

    def close(self) -> None:
        """Release files and handles; called once by ``Telemetry.close``."""


class JsonlSink(Sink):
    """One JSON object per line, appended; the file is flushed at every telemetry flush.

    ``target`` is a path (opened in append mode now, so a bad path fails at construction) or
    an open text file, which stays the caller's to close.  Non-finite floats are written as
    Python's ``json`` does (``NaN``, ``Infinity``): ``json.loads`` and pandas read them back.
    With ``fsync=True`` each flush is also forced to disk (a syscall per flush).
    Give each rank its own path (records carry ``"rank"``), e.g. ``f"telemetry-{rank}.jsonl"``.

    A flush is appended whole or not at all (to a path, or to a file opened in append mode): when
    the disk fills up mid-write, the file is cut back to its last complete line and ``write``
    raises ``OSError`` naming the file and the steps that were not written.  ``Telemetry`` then
    reports the sink once and disables it; the records still reach the other sinks.
    """

    def __init__(self, target: str | os.PathLike[str] | IO[str], *, fsync: bool = False) -> None:
        self.fsync = fsync
        if isinstance(target, (str, os.PathLike)):
            path = Path(target)
            if path.is_dir():
                raise ValueError(f"JsonlSink({str(target)!r}) is a directory; give a file path such as "
                                 f"{str(path / 'telemetry.jsonl')!r}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Unbuffered: each flush goes out in os.write calls that append_whole can undo.
                self._file: IO[Any] = open(path, "ab", buffering=0)  # noqa: SIM115 - held until close()
            except OSError as e:
                raise ValueError(f"JsonlSink({str(target)!r}) cannot open the file for appending: {e}; "
                                 "give a writable path") from e
            self._owned = True
            self.name = str(path)
        elif hasattr(target, "write"):
            self._file, self._owned = target, False
            self.name = getattr(target, "name", repr(target))
        else:
            raise TypeError(f"JsonlSink(target={target!r}): give a path or an open text file")

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        # One write per flush: lines of a flush are not interleaved with another writer's.
        text = "".join(dumps(r, NONFINITE_AS_TOKEN) + "\n" for r in records)
        if not (self._owned or "a" in getattr(self._file, "mode", "")):
            self._file.write(text)  # a stream we cannot cut back (StringIO, stdout, a file opened "w")
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            return
        self._file.flush()  # the caller's own buffered lines go first; also raises on a closed file
        try:
            append_whole(self._file.fileno(), text.encode("utf-8"), fsync=self.fsync)
        except OSError as e:
            first, last = records[0].get("step"), records[-1].get("step")
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            raise OSError(e.errno, f"{e.strerror}: {len(records)} record(s) ({steps}) were not written to "
                                   f"{self.name!r}; a partial last line is cut off, so every line in the file is "
                                   "a whole record") from e

    def close(self) -> None:
        if self._owned and not self._file.closed:
            self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({self.name!r})"


class TensorBoardSink(Sink):
    """Scalars per step (``{prefix}loss``, ``{prefix}scale``, ... and ``{prefix}skipped``) to TensorBoard.

    Per-module gradient absmax goes to ``{prefix}grad_absmax/<module>``, the fp8 operand statistics to
    ``{prefix}fp8_amax/<layer>/<operand>`` and ``{prefix}fp8_flush_fraction/<layer>/<operand>``; alarms to the text
    tab.  Needs ``torch.utils.tensorboard`` (``pip install 'ampkit[tensorboard]'``).  Only rank 0
    writes unless ``all_ranks=True`` (then each rank needs its own ``log_dir``).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, prefix: str = "ampkit/", all_ranks: bool = False,
                 **writer_kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                f"TensorBoardSink needs the tensorboard package ({e}); install it with "
                "`pip install 'ampkit[tensorboard]'` (or `pip install tensorboard`)"
            ) from e
        self.rank_zero_only = not all_ranks
        self.prefix = prefix
        self.log_dir = str(log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, **writer_kwargs)

    def write(self, records: Sequence[Record]) -> None:
        w, p = self.writer, self.prefix
        for r in records:
            step = r["step"]
            for key in SCALAR_KEYS:
                value = r.get(key)
                if isinstance(value, (int, float)):
                    w.add_scalar(p + key, value, step)
            w.add_scalar(p + "skipped", float(r["skipped"]), step)
            for name, value in (r.get("module_grad_absmax") or {}).items():
                w.add_scalar(f"{p}grad_absmax/{name}", value, step)
            for key in ("fp8_amax", "fp8_flush_fraction"):
                for layer, ops in (r.get(key) or {}).items():
                    for op, value in ops.items():
                        if value is not None:
                            w.add_scalar(f"{p}{key}/{layer}/{op}", value, step)
        w.flush()

    def alarm(self, event: Record) -> None:
        self.writer.add_text(self.prefix + "alarms", f"**{event['alarm']}** ({event['cause']}): {event['message']}",
                             event["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.log_dir!r})"


class ProgressSink(Sink):
    """A rich progress bar showing step, loss, loss scale and skipped steps; alarms print above it.

    It advances at each flush (the records reach the host only then).  Needs ``rich``
    (``pip install 'ampkit[report]'``).  Only rank 0 draws.
    """

    rank_zero_only = True

    def __init__(self, total: int | None = None, *, description: str = "train", console: Any = None) -> None:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError as e:
            raise ImportError(f"ProgressSink needs rich ({e}); install it with `pip install 'ampkit[report]'`") from e
        self.skips = 0
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("scale {task.fields[scale]}"),
            TextColumn("skipped {task.fields[skips]}"), TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task(description, total=total, loss="-", scale="-", skips=0)
        self.progress.start()

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        self.skips += sum(1 for r in records if r["skipped"])
        last = records[-1]
        self.progress.update(self.task, completed=last["step"], loss=_fmt(last["loss"]), scale=_fmt(last["scale"]),
                             skips=self.skips)

    def alarm(self, event: Record) -> None:
        self.progress.console.print(f"[bold red]{event['alarm']}[/] step {event['step']}: {event['message']}",
                                    markup=True, highlight=False)

    def close(self) -> None:
        self.progress.stop()


class CallbackSink(Sink):
    """Calls ``fn(record)`` for every step record and ``on_alarm(event)`` for every alarm.

    Each call gets its own copy, so a callback may keep or modify what it is given.
    """

    def __init__(self, fn: Callable[[Record], Any], *, on_alarm: Callable[[Record], Any] | None = None,
                 rank_zero_only: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackSink(fn={fn!r}): fn must be callable, e.g. records.append")
        self.fn, self.on_alarm, self.rank_zero_only = fn, on_alarm, rank_zero_only

    def write(self, records: Sequence[Record]) -> None:
        for r in records:
            self.fn(copy.deepcopy(r))

    def alarm(self, event: Record) -> None:
        if self.on_alarm is not None:
            self.on_alarm(copy.deepcopy(event))

    def __repr__(self) -> str:
        return f"CallbackSink({getattr(self.fn, '__qualname__', self.fn)!r})"


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def as_sink(obj: Any) -> Sink:
    """``obj`` as a sink: a Sink itself, or a callable taking one record wrapped in a ``CallbackSink``."""
    if isinstance(obj, Sink):
        return obj
    if callable(obj):
        return CallbackSink(obj)
    raise TypeError(f"Telemetry(sinks=[..., {obj!r}]): a sink must be an ampkit.telemetry Sink (JsonlSink, "
                    "TensorBoardSink, ProgressSink, CallbackSink) or a callable taking one record")
