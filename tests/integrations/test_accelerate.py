"""watch() on a hand-written Accelerate loop with torch's GradScaler("cpu") and fp16 autocast."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator

from ampkit.integrations.accelerate import StrategyWarning, Watcher, strategy_of, watch
from ampkit.integrations.setup_checks import PrecisionInEffect
from ampkit.telemetry import Telemetry


def _loop(*, schedule: str, bad_step: int = 3, steps: int = 6, give_scaler: bool = True) -> tuple[list[dict], Any]:
    """An Accelerate loop with its own fp16 autocast, a GradScaler("cpu"), fused AdamW and LambdaLR."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if not give_scaler:
        accelerator.scaler = scaler  # prepare() hands it to the AcceleratedOptimizer
    model, opt, sched = accelerator.prepare(model, opt, sched)
    records: list[dict] = []
    watcher = watch(accelerator, model, opt, scaler=scaler if give_scaler else None, scheduler=sched,
                    telemetry=Telemetry(sinks=[records.append], flush_every=4), precision="fp16")
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        if step == bad_step:
            model[0].weight.grad[0, 0] = math.inf  # an fp16 overflow
        scale = scaler.get_scale()
        if give_scaler:
            scaler.step(opt.optimizer)
            scaler.update()
        else:
            opt.step()  # AcceleratedOptimizer: scaler.step + update; step_was_skipped stays False (fused)
        if schedule == "always" or scaler.get_scale() >= scale:
            sched.step()
        opt.zero_grad()
    watcher.close()
    return records, watcher


def test_watch_overflow_with_fused_adamw_gives_a_skipped_record_and_a_scale_backoff() -> None:
    records, watcher = _loop(schedule="held_back")
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert (records[2]["scale"], records[2]["next_scale"]) == (1024.0, 512.0)
    assert "SCHEDULER_STEPPED_ON_SKIP" not in [f.code for f in watcher.findings if f.severity != "info"]


def test_watch_reports_the_scheduler_stepped_on_a_skipped_step() -> None:
    with pytest.warns(Warning, match="SCHEDULER_STEPPED_ON_SKIP at step 3"):
        _, watcher = _loop(schedule="always")
    stepped = [f for f in watcher.findings if f.code == "SCHEDULER_STEPPED_ON_SKIP" and f.severity != "info"]
    assert len(stepped) == 1 and stepped[0].step == 3


def test_watch_reads_the_accelerators_scaler_when_none_is_given() -> None:
    with pytest.warns(Warning, match="SCHEDULER_STEPPED_ON_SKIP"):
        records, watcher = _loop(schedule="always", give_scaler=False)
    assert records[2]["skipped"] and records[2]["next_scale"] == 512.0
    # Accelerate's step_was_skipped misses this skip with a fused optimizer (accelerate#4242); ampkit does not
    assert "SCHEDULER_STEPPED_ON_SKIP" in [f.code for f in watcher.findings if f.severity != "info"]


def test_watch_setup_checks_notes_that_ampkit_detects_fused_fp16_skips_itself() -> None:
    _, watcher = _loop(schedule="held_back", steps=1)
    notes = [f for f in watcher.findings if f.code == "SCHEDULER_STEPPED_ON_SKIP" and f.severity == "info"]
    assert len(notes) == 1 and "accelerate#4242" in notes[0].message


class DeepSpeedPlugin:
    """Stands for accelerate's plugin class of that name: detection goes by the class name only."""


def test_strategy_of_names_deepspeed_and_fsdp_by_class_name_without_importing_them() -> None:
    state = type("AcceleratorState", (), {"deepspeed_plugin": DeepSpeedPlugin()})()
    fsdp = type("FullyShardedDataParallel", (nn.Module,), {})()
    assert (strategy_of(state), strategy_of(fsdp), strategy_of(nn.Linear(2, 2))) == ("deepspeed", "fsdp", None)
    assert "deepspeed" not in sys.modules


def test_watcher_under_deepspeed_warns_what_works_and_keeps_recording() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[dict] = []
    with pytest.warns(StrategyWarning, match="does not read DeepSpeed's loss scaler"):
        watcher = Watcher(model, [opt], scaler=None, precision=PrecisionInEffect("bf16", "bf16"),
                          telemetry=[records.append], doctor=True, strategy="deepspeed")
    with watcher:
        for _ in range(2):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert watcher.doctor is None and [r["step"] for r in records] == [1, 2]


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()


class LossNet(nn.Module):
    """Returns its loss, as Hugging Face models do; ``log`` makes NaN of a negative input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log = Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log(self.fc(x).abs() + x).mean()


def test_watch_with_doctor_replays_a_nan_step_and_names_the_module() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(LossNet())
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(accelerator, model, opt, doctor=True) as watcher:
            for step in range(1, 4):
                x = torch.full((2, 4), -1e3 if step == 2 else 1.0)  # finite data; the log of it is NaN
                accelerator.backward(model(x))
                opt.step()
                opt.zero_grad()
    nan = [f for f in watcher.findings if f.code == "FORWARD_NAN"]
    assert nan and nan[0].module == "log" and nan[0].step == 2


def test_watch_with_doctor_replays_an_applied_nan_step_before_its_update_once() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)  # no scaler: the optimizer applies step 2's NaN gradients
    model = accelerator.prepare(LossNet())
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(accelerator, model, opt, doctor=True) as watcher:
            for step in range(1, 4):
                x = torch.ones(2, 4)
                if step == 2:
                    x[1, 3] = math.nan
                accelerator.backward(model(x))
                opt.step()
                opt.zero_grad()
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())
    doctor = [f for f in watcher.findings if "replay_reason" in f.evidence]
    assert [(f.code, f.module, f.step) for f in doctor] == [("NONFINITE_INPUT", "fc", 2)]
    assert doctor[0].evidence["consequence_steps"] == [3]


def test_import_ampkit_loads_no_training_framework() -> None:
    code = ("import sys, ampkit, ampkit.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["accelerate_loop.py", "hf_trainer.py"])
def test_examples_run_to_exit_0(name: str) -> None:
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / name
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_doctor_fp32_reference_of_an_accelerate_prepared_model_runs_in_fp32() -> None:
    # prepare() wraps forward on the instance in bf16 autocast; the doctor's fp32 copy must not keep
    # that wrapper, or it compares bf16 with bf16 and reads every module as lossless.
    from accelerate.state import AcceleratorState

    from ampkit.diagnose.step.api import diagnose_step

    AcceleratorState._reset_state(True)
    try:
        torch.manual_seed(0)
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        x = torch.randn(4, 8)

        def run(m: nn.Module) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x).float().pow(2).mean()

        result = diagnose_step(model, run, precision="bf16")
    finally:
        AcceleratorState._reset_state(True)
    sqnr = result.comparison["output_sqnr_db"]
    assert all(math.isfinite(v) for v in sqnr.values()), sqnr  # bf16 against a real fp32 reference
