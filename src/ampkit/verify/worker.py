"""One precision's run of the verify protocol, in its own process: ``python -m ampkit.verify.worker SPEC``.

``SPEC`` is a JSON file written by the harness (task reference, precision, device, steps,
warm-up, seed, evaluation interval, result path).  A fresh process per precision means a clean
peak-memory measurement (peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA), no
autocast weight cache or allocator state carried over, and a crash that cannot take the other
runs with it.

The run:

1. seed everything, build the model on CPU in fp32 and hash its ``state_dict`` (SHA-256 over
   names, dtypes, shapes and bytes): the harness refuses to compare runs whose hashes differ;
2. hash the first batches of the task's stream (``data_sha256``): same data order, checked;
3. train ``steps`` optimizer steps with ``MixedPrecision`` and ``ampkit.telemetry.Telemetry``
   (the same step records a user's telemetry gives; ``flush_every`` covers the whole run, so
   the records are read to the host only at evaluation points, outside the clock, and alarms
   only warn); the clock starts after ``warmup`` steps and stops around evaluations;
4. evaluate every ``eval_every`` steps and at the end, under the same autocast; a loss that
   stays non-finite, or a non-finite metric, ends the run as ``diverged``;
5. write the result atomically.  Progress goes to stdout as ``@ampkit-progress {json}`` lines:
   ``setup``, one ``train`` per step and one ``eval`` (with its ``seconds``) per evaluation.

With ``distributed: true`` in the spec (``ampkit verify --nproc N``) the same program runs on
every rank of a torchrun launch: DDP, ``ampkit.distributed.setup``, each rank on its slice of the
global batch (``ampkit.verify.ranks``), and only rank 0 writes the result.

On CUDA the fp32 baseline is IEEE fp32 (TF32 off for matmul and cuDNN) and deterministic
algorithms are requested (``warn_only``), so that repeated runs with one seed agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ampkit._util.digest import state_sha256
from ampkit._util.jsonfloat import NONFINITE_AS_NULL, dumps, to_json
from ampkit._util.speed import synchronize

__all__ = ["DATA_HASH_BATCHES", "DIVERGENCE_WINDOW", "PROGRESS_PREFIX", "RECORD_KEYS", "BatchesExhausted", "StepLog",
           "data_sha256", "emit", "main", "next_batch", "run", "train"]

PROGRESS_PREFIX = "@ampkit-progress "
DATA_HASH_BATCHES = 4
"""Batches hashed for ``data_sha256`` (read from a second stream, outside the timed region)."""
DIVERGENCE_WINDOW = 20
"""A run whose last 20 recorded losses are all non-finite has diverged."""


def emit(**event: Any) -> None:
    print(PROGRESS_PREFIX + json.dumps(event), flush=True)


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            digest.update(f"K|{key}|".encode())
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(f"L|{len(obj)}|".encode())
        for item in obj:
            _feed(digest, item)
    else:
        digest.update(f"V|{obj!r}|".encode())


class BatchesExhausted(RuntimeError):
    """A task's ``batches()`` stream ended before the run did."""


def next_batch(stream: Any, task: Any, taken: int) -> Any:
    """The stream's next batch; a stream that ends says so, with the fix, instead of a bare StopIteration."""
    try:
        return next(stream)
    except StopIteration:
        raise BatchesExhausted(
            f"task {getattr(task, 'name', task)!r}: batches(seed, device) ended after {taken} batches, but the run "
            "needs one per step: make it endless (loop over the data, reshuffling with the seed each epoch), or "
            "lower --steps") from None


def data_sha256(task: Any, seed: int, device: torch.device, count: int) -> str:
    digest = hashlib.sha256()
    stream = iter(task.batches(seed, device))
    for taken in range(count):
        _feed(digest, next_batch(stream, task, taken))
    return digest.hexdigest()


def _rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


class _Stopwatch:
    """Accumulates time over segments; each edge synchronises the device so queued work is counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = 0.0
        self._start: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            synchronize(self.device)
            self.total += time.perf_counter() - self._start
            self._start = None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


def _configure(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.reset_peak_memory_stats(device)
    return {"tf32": False, "deterministic_algorithms": device.type == "cuda", "threads": torch.get_num_threads()}


def train(spec: dict[str, Any], result: dict[str, Any], live: dict[str, Any]) -> None:
    from ampkit.tasks import load_task
    from ampkit.verify import ranks

    device = torch.device(spec["device"])
    info = ranks.init(device) if spec.get("distributed") else ranks.RankInfo(0, 1, device)
    device = info.device
    live["ranks"] = info
    result["world_size"] = info.world_size
    steps, warmup, seed, eval_every = spec["steps"], spec["warmup"], spec["seed"], spec["eval_every"]
    result["settings"] = _configure(device)
    task = load_task(spec["task"])
    if spec.get("size"):
        task = task.resized(spec["size"])  # type: ignore[attr-defined]  # a rung of the task's ladder
    emit(phase="setup", precision=spec["precision"])
    baseline_rss = _rss_bytes()
    _seed_everything(seed)
    model = task.build_model(seed)
    result["init_sha256"] = state_sha256(model)
    data_seed = spec.get("data_seed", seed)  # the noise run's own data order (ampkit.verify.noise)
    result["data_sha256"] = data_sha256(task, data_seed, device, min(steps, DATA_HASH_BATCHES))
    model.to(device)
    recorder = StepLog(steps)
    live["recorder"] = recorder  # lets run() keep the steps recorded before a crash
    mp, model, train_model, optimizer = _engine(spec, task, model, recorder, device)
    stream = iter(task.batches(data_seed, device))
    shadow = _ShadowLoss(task, spec["shadow_seed"], device, info) if spec.get("shadow_seed") is not None else None
    clock = _Stopwatch(device)
    history: list[dict[str, Any]] = []
    result["eval_history"] = history
    model.train()  # _evaluate switches back to train mode after each evaluation
    for step in range(steps):
        if step == warmup:
            clock.start()
        batch = ranks.shard_batch(next_batch(stream, task, step), info, task.samples_per_batch)
        if shadow is not None:
            shadow.read(model, mp)
        with mp.no_sync(train_model):  # DDP's no_sync covers the forward and the backward
            with mp.autocast():
                loss = task.loss(train_model, batch)
            mp.backward(loss)
        mp.step(optimizer)
        done = step + 1
        emit(phase="train", step=done)
        if done % eval_every == 0 or done == steps:
            clock.stop()
            history.append({"step": done, "metrics": _evaluate(task, model, mp, device, done)})
            reason = _divergence(recorder, history[-1]["metrics"])
            if ranks.any_rank(reason is not None, info):  # every rank stops together, or none does
                reason = reason or "another rank diverged"
                result["status"], result["error"] = "diverged", f"diverged at step {done}: {reason}"
                break
            if warmup < done < steps:
                clock.start()
    clock.stop()
    _finish(spec, task, recorder, history, clock, result, device, baseline_rss, info)
    if shadow is not None:
        result["shadow_loss"] = shadow.values()


class _ShadowLoss:
    """The noise run's loss on the baseline's batch of each step, read before the step (no gradients).

    The baseline records its loss on the same batch before its own update, so the two curves are
    read on the same data.  The losses stay on the device until ``values()`` (one copy at the
    end); each read is one forward, inside the timed region, but the noise run's speed is not
    reported.  The bare module is used: no DDP collectives in a forward without backward.
    """

    def __init__(self, task: Any, seed: int, device: torch.device, info: Any) -> None:
        from ampkit.verify import ranks

        self._task, self._info, self._shard = task, info, ranks.shard_batch
        self._stream = iter(task.batches(seed, device))
        self._losses: list[torch.Tensor] = []

    def read(self, model: torch.nn.Module, mp: Any) -> None:
        batch = self._shard(next_batch(self._stream, self._task, len(self._losses)), self._info,
                            self._task.samples_per_batch)
        with torch.no_grad(), mp.autocast():
            self._losses.append(self._task.loss(model, batch).detach().float())

    def values(self) -> list[float | None]:
        from ampkit.verify.ranks import mean_over_ranks

        if not self._losses:
            return []
        mean = mean_over_ranks(torch.stack(self._losses).double().tolist(), self._info)
        return [to_json(v, NONFINITE_AS_NULL) for v in mean]


def _engine(spec: dict[str, Any], task: Any, model: torch.nn.Module, recorder: StepLog,
            device: torch.device) -> tuple[Any, torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """The engine, the model it prepared, the model to train (DDP under torchrun) and the optimizer."""
    from ampkit.mixed_precision import MixedPrecision

    mp = MixedPrecision(spec["precision"], device=device, telemetry=recorder.telemetry,
                        clip_grad_norm=getattr(task, "clip_grad_norm", None))
    # prepare() before DDP and before the optimizer: fp8 swaps the Linear layers for torchao's
    # (maybe a new root object), and DDP and the optimizer must see the modules that train.
    model = mp.prepare(model)
    optimizer = task.build_optimizer(model)
    train_model = _wrap_ddp(model, device) if spec.get("distributed") else model
    if spec.get("distributed"):
        from ampkit.distributed import setup

        setup(mp)  # same configuration on every rank (checked) and the same skip decision
    return mp, model, train_model, optimizer


def _wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    # DDP broadcasts rank 0's weights at construction; every rank built the same ones anyway
    # (same seed, hash recorded).  Evaluation uses the bare module: no collectives there.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


RECORD_KEYS = ("step", "loss", "loss_nonfinite", "scale", "skipped", "grad_norm")
"""The keys of ``ampkit.telemetry``'s step records that the verify report keeps per step."""


class StepLog:
    """The run's step records, from ``ampkit.telemetry.Telemetry`` with a ``CallbackSink``.

    ``flush_every`` is longer than the run (``steps + 1``: a flush on the last step would sync
    inside the timed region), so the device rows reach the host only when ``flush()`` is called: at evaluation points (outside the clock) and at the end -- one copy per evaluation
    instead of one sync per step.  No alarms: verify records a run that goes bad, it does not
    stop it (divergence is judged here, at evaluation points).  ``watch_inputs`` is off: the
    per-forward input check is not part of the protocol, and its cost would dilute the measured
    precision speed-up.
    """

    def __init__(self, steps: int) -> None:
        from ampkit.telemetry import CallbackSink, Telemetry
        from ampkit.telemetry.core import MAX_FLUSH_EVERY

        self._records: list[dict[str, Any]] = []
        # A run of more steps than the buffer's bound flushes once per bound: one sync in 100,000 steps.
        self.telemetry = Telemetry(sinks=[CallbackSink(self._records.append)], flush_every=min(steps + 1, MAX_FLUSH_EVERY),
                                   alarms=(), watch_inputs=False)

    def flush(self) -> None:
        """Read the pending rows to the host (one sync): call it outside the timed region."""
        self.telemetry.flush()

    def recent_losses(self, count: int) -> list[float]:
        self.flush()
        return [r["loss"] for r in self._records[-count:]]

    def records(self) -> list[dict[str, Any]]:
        """The records so far, ``RECORD_KEYS`` only, as plain Python values."""
        self.flush()
        return [{key: r[key] for key in RECORD_KEYS} for r in self._records]


def _evaluate(task: Any, model: torch.nn.Module, mp: Any, device: torch.device,
              step: int) -> dict[str, float | None]:
    started = time.perf_counter()
    model.eval()
    with torch.no_grad(), mp.autocast():
        metrics = task.evaluate(model, device)
    model.train()
    emit(phase="eval", step=step, seconds=time.perf_counter() - started)  # the parent's time estimate uses it
    missing = sorted(set(task.metrics) - set(metrics))
    if missing:
        raise RuntimeError(f"task {task.name!r}: evaluate() returned {sorted(metrics)} but declares metrics "
                           f"{sorted(task.metrics)}; missing {missing}")
    return {name: to_json(float(metrics[name]), NONFINITE_AS_NULL) for name in task.metrics}


def _divergence(recorder: Any, metrics: dict[str, float | None]) -> str | None:
    bad = [name for name, value in metrics.items() if value is None]
    if bad:
        return f"evaluation metric(s) {', '.join(bad)} are not finite"
    recent = recorder.recent_losses(DIVERGENCE_WINDOW)
    if len(recent) == DIVERGENCE_WINDOW and not any(math.isfinite(x) for x in recent):
        return f"the loss was non-finite for the last {DIVERGENCE_WINDOW} steps"
    return None


def _store_records(recorder: Any, result: dict[str, Any], info: Any = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = recorder.records()
    if info is not None:
        from ampkit.verify.ranks import average_step_losses

        average_step_losses(records, info)
    for r in records:
        r["loss"] = to_json(r["loss"], NONFINITE_AS_NULL)
        r["grad_norm"] = to_json(r["grad_norm"], NONFINITE_AS_NULL)
    result["steps"] = records
    result["loss"] = [r["loss"] for r in records]
    result["skipped_steps"] = sum(r["skipped"] for r in records)
    result["nonfinite_steps"] = sum(r["loss_nonfinite"] for r in records)
    return records


def _finish(spec: dict[str, Any], task: Any, recorder: Any, history: list[dict[str, Any]], clock: _Stopwatch,
            result: dict[str, Any], device: torch.device, baseline_rss: int, info: Any) -> None:
    records = _store_records(recorder, result, info)
    result["eval"] = history[-1]["metrics"] if history else {}
    timed_steps = max(0, len(records) - spec["warmup"])
    seconds = clock.total
    rate = timed_steps / seconds if seconds > 0 and timed_steps > 0 else None
    result["throughput"] = {
        "timed_steps": timed_steps,
        "timed_s": seconds,
        "warmup_steps": spec["warmup"],
        "steps_per_s": rate,
        "samples_per_s": rate * task.samples_per_batch if rate else None,
        "tokens_per_s": rate * task.tokens_per_batch if rate and task.tokens_per_batch else None,
    }
    if device.type == "cuda":
        peak, base, kind = int(torch.cuda.max_memory_allocated(device)), 0, "cuda_max_memory_allocated"
    else:
        peak, base, kind = _rss_bytes(), baseline_rss, "peak_rss"
    result["peak_memory_bytes"] = peak
    result["memory"] = {"kind": kind, "peak_bytes": peak, "baseline_bytes": base, "training_bytes": peak - base}
    if result.get("status") != "diverged":
        result["status"] = "ok"


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one precision and return its result (a crash becomes ``status: failed`` with the error)."""
    started = time.perf_counter()
    result: dict[str, Any] = {"precision": spec["precision"], "device": spec["device"], "status": "failed",
                              "error": None}
    live: dict[str, Any] = {}
    try:
        train(spec, result, live)
    except Exception as exc:
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = "".join(traceback.format_exception(exc)[-12:])
        traceback.print_exc()
        if "recorder" in live:
            # The curve up to the crash is evidence too; a device in an error state cannot be read
            # back, and then the error alone is kept.
            with contextlib.suppress(Exception):
                _store_records(live["recorder"], result)
    result["wall_s"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    from ampkit._util.io import atomic_write_bytes

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ampkit.verify.worker SPEC.json (written by `ampkit verify`)", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    try:
        result = run(spec)
    finally:
        if spec.get("distributed"):
            from ampkit.verify import ranks

            ranks.close()
    # Under torchrun rank 0 writes the result (every rank holds the same records after the
    # reduction); a failing rank's traceback is in its stderr, which the harness reports.
    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write_bytes(spec["result"], dumps(result, NONFINITE_AS_NULL).encode())
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
