"""Sinks: JSONL, TensorBoard, rich progress, callback; a failing sink never ends training."""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit.telemetry import (
    CallbackSink,
    JsonlSink,
    LossNonFiniteAlarm,
    ProgressSink,
    SinkFailedWarning,
    Telemetry,
    TensorBoardSink,
    make_telemetry,
)
from tests.helpers.mounts import run_after_mounting, tmpfs

from .telemetry_helpers import batch, train_step

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}


class Run:
    """One engine with ``tel`` on ``model``; ``run(n)`` trains n more steps."""

    def __init__(self, tel: Telemetry | object, model: torch.nn.Module, precision: str = "bf16",
                 **kw: object) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        self.mp = ampkit.MixedPrecision(precision, device="cpu", telemetry=tel, **kw)  # type: ignore[arg-type]
        self.mp.prepare(model)

    def run(self, steps: int) -> Run:
        for _ in range(steps):
            train_step(self.mp, self.model, self.opt, *batch())
        return self


def _train(tel: Telemetry | object, model: torch.nn.Module, steps: int, precision: str = "bf16",
           **kw: object) -> ampkit.MixedPrecision:
    return Run(tel, model, precision, **kw).run(steps).mp


def test_telemetry_sink_jsonl_appends_one_record_per_line(tiny: torch.nn.Module, tmp_path: Path) -> None:
    path = tmp_path / "runs" / "telemetry.jsonl"  # the folder is created
    path.parent.mkdir()
    path.write_text('{"earlier": true}\n')
    tel = Telemetry(sinks=[JsonlSink(path)], flush_every=3)
    _train(tel, tiny, 5)
    assert len(path.read_text().splitlines()) == 1 + 3  # flushed at step 3, the rest still on the device
    tel.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"earlier": True}
    assert [r["step"] for r in lines[1:]] == [1, 2, 3, 4, 5]
    assert all(isinstance(r["loss"], float) and r["rank"] == 0 for r in lines[1:])


def test_telemetry_sink_disk_full_is_reported_once_and_training_continues(tiny: torch.nn.Module) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system to produce a real ENOSPC")
    kept: list[dict] = []
    full = JsonlSink("/dev/full")  # every write fails with ENOSPC, like a full disk
    tel = Telemetry(sinks=[full, CallbackSink(kept.append)], flush_every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = _train(tel, tiny, 6)
        tel.close()
    failures = [w for w in caught if issubclass(w.category, SinkFailedWarning)]
    assert len(failures) == 1, [str(w.message) for w in failures]
    assert "/dev/full" in str(failures[0].message) and "No space left" in str(failures[0].message)
    assert "2 record(s) (steps 1-2) were not written" in str(failures[0].message)
    assert full not in tel.sinks and mp.optimizer_steps == 6
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 6]


# Trains on a 64 KiB disk until the JSONL file fills it, then copies the file out of the mount
# (argv[3]) and prints the SinkFailedWarning messages and the steps trained.
TRAIN_ON_A_SMALL_DISK = """
import json, shutil, sys, warnings
import torch, ampkit
from ampkit.telemetry import JsonlSink, SinkFailedWarning, Telemetry
path, how, copy = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
target = path if how == "path" else open(path, "a")
mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=Telemetry(sinks=[JsonlSink(target)], flush_every=7))
mp.prepare(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(700):
        with mp.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    mp.close()
shutil.copyfile(path, copy)
print(json.dumps({"steps": mp.optimizer_steps,
                  "failures": [str(w.message) for w in caught if issubclass(w.category, SinkFailedWarning)]}))
"""


@pytest.mark.parametrize("how", ["path", "append_mode_file"])
def test_telemetry_sink_jsonl_on_a_full_disk_keeps_only_whole_lines_and_names_the_lost_steps(
        tmp_path: Path, how: str) -> None:
    disk, copy = tmp_path / "disk", tmp_path / "copy.jsonl"
    disk.mkdir()
    result = run_after_mounting(tmpfs(disk, "64k"), [sys.executable, "-c", TRAIN_ON_A_SMALL_DISK,
                                                     str(disk / "t.jsonl"), how, str(copy)], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["steps"] == 700, "training goes on after the disk is full"
    lines = copy.read_text().splitlines(keepends=True)
    assert 0 < len(lines) < 700, "the 64 KiB disk should fill up part way"
    assert all(line.endswith("\n") for line in lines), "the last line was cut in the middle"
    steps = [json.loads(line)["step"] for line in lines]  # every line parses
    assert steps == list(range(1, len(lines) + 1)) and len(lines) % 7 == 0, "whole flushes only"
    assert len(outcome["failures"]) == 1, outcome["failures"]
    assert f"7 record(s) (steps {len(lines) + 1}-{len(lines) + 7}) were not written" in outcome["failures"][0]
    assert "No space left" in outcome["failures"][0] and "t.jsonl" in outcome["failures"][0]


def test_telemetry_sink_file_closed_under_it_is_disabled(tiny: torch.nn.Module, tmp_path: Path) -> None:
    f = open(tmp_path / "t.jsonl", "w")  # noqa: SIM115 - closed under the sink on purpose
    tel = Telemetry(sinks=[JsonlSink(f)], flush_every=1)
    run = Run(tel, tiny).run(1)
    f.close()
    with pytest.warns(SinkFailedWarning, match="closed file"):
        run.run(2)
    assert tel.sinks == []
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 1


def test_telemetry_sink_raising_callback_is_disabled(tiny: torch.nn.Module) -> None:
    calls = []

    def broken(record: dict) -> None:
        calls.append(record["step"])
        raise RuntimeError("dashboard unreachable")

    tel = Telemetry(sinks=[broken], flush_every=1)
    with pytest.warns(SinkFailedWarning, match="dashboard unreachable"):
        _train(tel, tiny, 3)
    assert calls == [1]


def test_telemetry_sink_jsonl_bad_path_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        JsonlSink(tmp_path)
    with pytest.raises(ValueError, match="cannot open the file"):
        JsonlSink("/proc/ampkit-telemetry.jsonl")
    with pytest.raises(TypeError, match="give a path or an open text file"):
        JsonlSink(42)  # type: ignore[arg-type]


def test_telemetry_sink_tensorboard_events_load_back(tiny: torch.nn.Module, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'ampkit[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records: list[dict] = []
    tel = Telemetry(sinks=[TensorBoardSink(tmp_path / "tb"), records.append], flush_every=2,
                    module_absmax_every=2)
    _train(tel, tiny, 4, precision="fp16", scaler=ampkit.DynamicLossScaler(init_scale=2.0**22))
    tel.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"ampkit/loss", "ampkit/scale", "ampkit/grad_norm", "ampkit/skipped", "ampkit/zero_grad_fraction",
            "ampkit/nonfinite_grads", "ampkit/lr", "ampkit/clip_coef", "ampkit/grad_absmax/body.0"} <= tags
    loss = events.Scalars("ampkit/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.value for e in events.Scalars("ampkit/skipped")] == [float(r["skipped"]) for r in records]
    assert [e.step for e in events.Scalars("ampkit/grad_absmax/emb")] == [1, 3]


def test_telemetry_sink_tensorboard_records_alarms_as_text(tiny: torch.nn.Module, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'ampkit[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tel = Telemetry(sinks=[TensorBoardSink(tmp_path / "tb")], flush_every=1, alarms=[LossNonFiniteAlarm()])
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    x, idx, y = batch()
    x[0, 0] = math.nan
    with pytest.warns(ampkit.AlarmWarning):
        train_step(mp, tiny, opt, x, idx, y)
    tel.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("ampkit/alarms/text_summary")
    assert b"LOSS_NONFINITE" in text.tensor_proto.string_val[0]


@pytest.mark.parametrize("module, build, extra", [
    ("torch.utils.tensorboard", lambda tmp: TensorBoardSink(tmp), "ampkit[tensorboard]"),
    ("rich.progress", lambda tmp: ProgressSink(), "ampkit[report]"),
])
def test_telemetry_sink_missing_dependency_names_the_extra(module: str, build, extra: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail as if not installed
    with pytest.raises(ImportError, match=re.escape(f"pip install '{extra}'")):
        build(tmp_path)


def test_telemetry_sink_progress_shows_loss_scale_and_skips(tiny: torch.nn.Module) -> None:
    pytest.importorskip("rich", reason="rich is not installed (pip install 'ampkit[report]')")
    from rich.console import Console

    out = io.StringIO()
    records: list[dict] = []
    sink = ProgressSink(total=4, console=Console(file=out, width=160, force_terminal=False))
    tel = Telemetry(sinks=[sink, records.append], flush_every=2)
    _train(tel, tiny, 4, precision="fp16", scaler=ampkit.DynamicLossScaler(init_scale=2.0**22))
    tel.close()
    text = out.getvalue()
    skips = sum(r["skipped"] for r in records)
    assert skips >= 1 and sink.skips == skips
    assert "4/4" in text and f"skipped {skips}" in text
    assert f"loss {records[-1]['loss']:.4g}" in text and f"scale {records[-1]['scale']:.4g}" in text


def test_telemetry_sink_callback_gets_copies_and_alarms(tiny: torch.nn.Module) -> None:
    seen: list[dict] = []
    alarms: list[dict] = []

    def mutate(record: dict) -> None:
        record["loss"] = "changed"
        seen.append(record)

    tel = Telemetry(sinks=[CallbackSink(mutate, on_alarm=alarms.append), CallbackSink(seen.append)],
                    flush_every=1, alarms=[LossNonFiniteAlarm()])
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    x, idx, y = batch()
    x[1, 1] = math.nan
    with pytest.warns(ampkit.AlarmWarning):
        train_step(mp, tiny, opt, x, idx, y)
    assert seen[0]["loss"] == "changed" and isinstance(seen[1]["loss"], float)  # the second sink is unaffected
    assert [a["alarm"] for a in alarms] == ["LOSS_NONFINITE"]


def test_telemetry_make_telemetry_accepts_the_documented_specs(tmp_path: Path) -> None:
    tel = Telemetry()
    assert ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel).telemetry is tel
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=str(tmp_path / "a.jsonl"))
    assert isinstance(mp.telemetry.sinks[0], JsonlSink)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=[JsonlSink(tmp_path / "b.jsonl"), print])
    assert [type(s).__name__ for s in mp.telemetry.sinks] == ["JsonlSink", "CallbackSink"]
    assert isinstance(ampkit.MixedPrecision("bf16", device="cpu", telemetry=True).telemetry, Telemetry)
    assert isinstance(mp.telemetry, ampkit.EngineHook) and mp.telemetry in mp.hooks


@pytest.mark.parametrize("spec, error, match", [
    ("run.txt", ValueError, "must end in .jsonl"),
    (42, TypeError, "use a Telemetry"),
    ([object()], TypeError, "a sink must be"),
])
def test_telemetry_make_telemetry_rejects_bad_specs(spec: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ampkit.MixedPrecision("bf16", device="cpu", telemetry=spec)


def test_telemetry_bound_to_one_engine_only() -> None:
    tel = Telemetry()
    ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    with pytest.raises(ValueError, match="already attached to another"):
        make_telemetry(tel, ampkit.MixedPrecision("bf16", device="cpu"))
    with pytest.raises(ValueError, match="flush_every=0"):
        Telemetry(flush_every=0)


def test_telemetry_input_nonfinite_is_none_when_no_model_is_watched(tiny: torch.nn.Module) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=1, watch_inputs=False)
    _train(tel, tiny, 1)
    assert records[0]["input_nonfinite"] is None and len(tiny._forward_pre_hooks) == 0


def test_telemetry_close_removes_the_input_hook_and_is_idempotent(tiny: torch.nn.Module) -> None:
    tel = Telemetry(flush_every=10)
    _train(tel, tiny, 2)
    assert len(tiny._forward_pre_hooks) == 1
    tel.close()
    tel.close()
    assert len(tiny._forward_pre_hooks) == 0 and tel.pending == 0


def test_telemetry_refuses_a_flush_interval_whose_buffer_would_not_fit() -> None:
    from ampkit.telemetry.core import MAX_FLUSH_EVERY

    with pytest.raises(ValueError, match=f"flush_every=1000000000.*from 1 to {MAX_FLUSH_EVERY}"):
        Telemetry(flush_every=10**9)
    assert Telemetry(flush_every=MAX_FLUSH_EVERY).flush_every == MAX_FLUSH_EVERY


def test_telemetry_writes_its_pending_records_when_the_process_ends_without_close(tmp_path) -> None:
    import json
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "tel.jsonl"
    script = textwrap.dedent(f"""
        import torch, ampkit
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tel = ampkit.Telemetry([ampkit.JsonlSink({str(out)!r})], flush_every=50, alarms=())
        mp = ampkit.MixedPrecision("fp16", device="cpu", telemetry=tel)
        mp.prepare(model)
        for step in range(120):
            x = torch.randn(8, 4)
            if step == 115:
                x[0, 0] = float("inf")  # the step that went wrong, among the last unflushed ones
            with mp.autocast():
                loss = model(x).float().pow(2).mean()
            mp.backward(loss)
            mp.step(opt)
        raise RuntimeError("the training script crashed before mp.close()")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "crashed before mp.close()" in proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 121))  # 100 flushed in the run, 20 at exit
    assert records[115]["loss_nonfinite"] and records[115]["skipped"]
