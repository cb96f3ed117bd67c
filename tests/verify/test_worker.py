"""StepLog: verify's step records come from ampkit.telemetry and equal what the engine reports."""

from __future__ import annotations

import math

import torch

import ampkit
from ampkit.verify.worker import RECORD_KEYS, StepLog


def _train(precision: str, scaler: ampkit.LossScaler | None, inputs: list[torch.Tensor], accumulation: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    recorder = StepLog(len(inputs))
    mp = ampkit.MixedPrecision(precision, device="cpu", scaler=scaler, telemetry=recorder.telemetry,
                               grad_accumulation=accumulation)
    mp.prepare(model)
    expected = []
    losses: list[float] = []
    for x in inputs:
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        losses.append(loss.item())  # the reference reads every value on the host, step by step
        mp.backward(loss)
        result = mp.step(opt)
        if result.boundary:
            expected.append({
                "loss": sum(losses) / len(losses), "scale": result.scale.item(), "skipped": result.skipped,
                "grad_norm": result.grad_norm.item(),
            })
            losses = []
    return recorder, expected


def test_steplog_matches_step_results_with_loss_scaling() -> None:
    inputs = [torch.randn(8, 4) for _ in range(6)]
    inputs[3][0, 0] = math.inf  # a non-finite batch: non-finite loss, skipped step, scale backs off
    scaler = ampkit.DynamicLossScaler(init_scale=1024.0, growth_interval=1)
    recorder, expected = _train("fp16", scaler, inputs)
    records = recorder.records()
    assert [tuple(r) for r in records] == [RECORD_KEYS] * 6
    assert [r["step"] for r in records] == list(range(1, 7))
    for got, want in zip(records, expected):
        assert got["scale"] == want["scale"] and got["skipped"] == want["skipped"]
        assert got["loss_nonfinite"] == (not math.isfinite(want["loss"]))
        if math.isfinite(want["loss"]):
            assert got["loss"] == want["loss"]
            assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-6)
    assert [r["skipped"] for r in records] == [False, False, False, True, False, False]
    assert [r["scale"] for r in records] == [1024.0, 2048.0, 4096.0, 8192.0, 4096.0, 8192.0]


def test_steplog_averages_losses_over_accumulation_window() -> None:
    inputs = [torch.randn(8, 4) for _ in range(4)]
    recorder, expected = _train("fp32", None, inputs, accumulation=2)
    records = recorder.records()
    assert len(records) == 2
    for got, want in zip(records, expected):
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6) and got["scale"] == 1.0


def test_steplog_keeps_values_on_the_device_until_flushed() -> None:
    recorder, _ = _train("bf16", None, [torch.randn(8, 4) for _ in range(3)])
    assert recorder.telemetry.pending == 3  # nothing read to the host during training
    assert len(recorder.recent_losses(2)) == 2
    assert recorder.telemetry.pending == 0
    assert [r["step"] for r in recorder.records()] == [1, 2, 3]


def test_a_task_whose_batches_run_out_fails_the_run_with_the_count_and_the_fix(tmp_path) -> None:
    from ampkit.verify.worker import run
    from tests.verify.verify_helpers import task_ref

    spec = {"task": task_ref("Finite"), "precision": "fp32", "device": "cpu", "steps": 20, "warmup": 2, "seed": 0,
            "eval_every": 20, "result": str(tmp_path / "r.json")}
    result = run(spec)
    assert result["status"] == "failed"
    assert result["error"].startswith("BatchesExhausted: task 'finite': batches(seed, device) ended after 10 batches")
    assert "make it endless" in result["error"] and len(result["loss"]) == 10  # the 10 steps it did train are kept
