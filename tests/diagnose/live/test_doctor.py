"""ReplayDoctor: a cheap capture every step, a full replay only for a failing one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from typing_extensions import override

import ampkit
from ampkit.diagnose.live import ReplayDoctor
from ampkit.diagnose.live import doctor as doctor_module
from ampkit.hooks import EngineHook, HookedEngine, HookEvent
from diagnose import doctor_models as dm


def _mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))


def _train(model: nn.Module, mp: ampkit.MixedPrecision, batches: list[torch.Tensor], opt: torch.optim.Optimizer,
           accumulate: int = 1) -> None:
    for x in batches:
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)


def _batches(n: int, nan_at: int | None = None, rows: int = 4) -> list[torch.Tensor]:
    out = [torch.randn(rows, 8) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][1, 3] = float("nan")
    return out


def test_replay_healthy_run_stores_only_the_capture() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    batches = _batches(4)
    _train(model, mp, batches, torch.optim.SGD(model.parameters(), lr=0.1))
    doctor = mp.doctor
    assert doctor.replays == 0 and doctor.findings == [] and doctor.results == []
    last = doctor._last
    assert last is not None and last.step == 4 and len(last.calls) == 1
    call = last.calls[0]
    assert call.args[0] is batches[-1]  # a reference, not a copy
    assert call.grads[0] is not None and call.grads[0].shape == (4, 1)
    assert call.autocast == ("cpu", torch.bfloat16, True)
    assert doctor.hooks.captures == [] and doctor._pending == []  # nothing accumulates across steps


def test_replay_captures_a_prepared_model_called_inside_another_once() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    mp.prepare(model[0])  # runs inside model's forward: part of model's replay, not a call of its own
    _train(model, mp, _batches(2), torch.optim.SGD(model.parameters(), lr=0.1))
    last = mp.doctor._last
    assert last is not None and [c.root for c in last.calls] == [model]
    assert last.calls[0].grads[0] is not None and last.calls[0].grads[0].shape == (4, 1)


def test_replay_triggers_only_on_the_bad_step() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    _train(model, mp, _batches(6, nan_at=3), torch.optim.SGD(model.parameters(), lr=0.1))
    assert mp.doctor.replays == 1
    (f,) = mp.doctor.findings
    assert (f.code, f.step, f.module) == ("NONFINITE_INPUT", 4, "0")
    assert f.evidence["nan_rows"] == [1]
    assert f.evidence["replay_reason"] == "non-finite loss"


def test_replay_does_not_change_the_training_run() -> None:
    def run(doctor: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model = _mlp(dropout=0.3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=doctor)
        mp.prepare(model)
        _train(model, mp, _batches(5, nan_at=2), opt)
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, doctored = run(False), run(True)
    assert all(torch.equal(plain[k], doctored[k]) for k in plain)


def test_replay_captures_the_first_step() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    _train(model, mp, _batches(2, nan_at=0), torch.optim.SGD(model.parameters(), lr=0.1))
    assert [f.step for f in mp.doctor.findings] == [1]


class Spiky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.ffn = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.ffn(self.embed(x))))


def test_replay_fp16_forward_overflow_names_the_module() -> None:
    model = Spiky()
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
        model.embed.bias.zero_()
        model.ffn.weight.fill_(2000.0)  # fine for inputs ~0.01, overflows fp16 for inputs ~5
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = [torch.rand(2, 4) * 0.01, torch.rand(2, 4) * 0.01, torch.full((2, 4), 5.0)]
    for x in batches:
        with mp.autocast():
            loss = model(x).float().mean()
        mp.backward(loss)
        result = mp.step(opt)
    assert result.skipped
    errors = [f for f in mp.doctor.findings if f.severity == "error"]
    assert errors and errors[0].code == "FORWARD_OVERFLOW" and errors[0].module == "ffn"
    assert errors[0].step == 3
    assert mp.doctor.results[-1].keep_fp32 is not None


def test_replay_ordinary_dynamic_scaling_is_reported_once() -> None:
    model = _mlp()
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**24, growth_interval=1000)
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True, scaler=scaler)
    mp.prepare(model)
    _train(model, mp, _batches(6, rows=2), torch.optim.SGD(model.parameters(), lr=0.01))
    assert mp.doctor.replays == 1
    (f,) = mp.doctor.findings
    assert (f.code, f.severity) == ("BACKWARD_OVERFLOW", "info")
    assert f.evidence["loss_scale"] == 2.0**24
    # Replayed from the gradient kept before `.float()`'s cast: the overflow at that cast is
    # reproduced op by op and judged at scale 1, not guessed.
    assert f.evidence["overflows_at_scale_1"] is False and f.op == "aten::_to_copy"


def test_replay_scale_collapse_classifies_the_cause() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    _train(model, mp, _batches(2, nan_at=1), torch.optim.SGD(model.parameters(), lr=0.1))
    found = mp.doctor.replay(reason="SCALE_COLLAPSE")
    collapse = [f for f in found if f.code == "SCALE_COLLAPSE"]
    assert collapse[0].evidence["cause"] == "nonfinite_data_or_loss"
    assert collapse[0].module == "0"

    model = _mlp()
    with torch.no_grad():
        model[3].weight.fill_(3e3)
        model[0].weight.fill_(30.0)
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True, scaler="static")
    mp.prepare(model)
    mp.doctor.max_replays = 0  # only the explicit replay below
    _train(model, mp, [torch.rand(2, 8) * 1e-3], torch.optim.SGD(model.parameters(), lr=0.01))
    found = mp.doctor.replay(reason="SCALE_COLLAPSE")
    collapse = [f for f in found if f.code == "SCALE_COLLAPSE"]
    assert collapse[0].evidence["cause"] == "gradient_overflow"


def test_replay_with_gradient_accumulation_finds_the_bad_micro_batch() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True, grad_accumulation=2)
    mp.prepare(model)
    _train(model, mp, _batches(4, nan_at=3), torch.optim.SGD(model.parameters(), lr=0.1))
    (f,) = mp.doctor.findings
    assert f.code == "NONFINITE_INPUT" and f.step == 2
    assert mp.doctor.results[-1] is not None and len(mp.doctor.results) == 2  # micro-batch 1 replayed clean


def test_replay_keep_last_false_holds_nothing_between_healthy_steps() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.doctor.keep_last = False
    mp.prepare(model)
    _train(model, mp, _batches(3), torch.optim.SGD(model.parameters(), lr=0.1))
    assert mp.doctor._last is None and mp.doctor.hooks.captures == []
    assert mp.doctor.replay("manual") == []


def test_replay_seeds_the_replay_with_the_full_output_gradient(replay_seeds: list[list[Any]]) -> None:
    model = nn.Linear(4, 3)
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with mp.autocast():
        out = model(torch.randn(2, 4))
    loss = out.float().sum() + 2 * out.sum().float()  # the cast sees 1.0, out receives 3.0
    mp.backward(loss)
    mp.step(opt)
    mp.doctor.replay()
    (grad,) = replay_seeds[0]
    assert torch.equal(grad.float(), torch.full((2, 3), 3.0))


def test_replay_doctor_is_built_without_an_engine_and_attached_as_a_hook() -> None:
    doctor = ReplayDoctor(max_replays=1, keep_last=True, shadow=False, bisect=False)
    assert doctor.engine is None
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", hooks=[doctor])
    mp.prepare(model)
    doctor.on_attach(mp)  # idempotent for the same engine
    assert doctor.engine is mp and id(model) in doctor.hooks.roots
    _train(model, mp, _batches(6, nan_at=3), torch.optim.SGD(model.parameters(), lr=0.1))
    assert doctor.replays == 1 and doctor.findings[0].code == "NONFINITE_INPUT"
    with pytest.raises(ValueError, match="another engine"):
        doctor.on_attach(ampkit.MixedPrecision("bf16", device="cpu"))


def test_replay_reads_the_failure_flag_once_per_healthy_cpu_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = doctor_module.failure_flag

    def counted(*args: Any) -> torch.Tensor | None:
        reads.append(1)
        return real(*args)

    monkeypatch.setattr(doctor_module, "failure_flag", counted)
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    _train(model, mp, _batches(4), torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(reads) == 4 and mp.doctor.replays == 0


class _FoundInfAfterTheDoctor(EngineHook):
    """Marks the step's found_inf after the doctor's before_optimizer_step has read it (a later hook's change)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    @override
    def before_optimizer_step(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        if engine.optimizer_steps + 1 == self.at_step:
            found_inf.fill_(1.0)


def test_replay_decides_on_the_found_inf_a_later_hook_changed() -> None:
    doctor = ReplayDoctor(shadow=False, bisect=False)
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", hooks=[doctor, _FoundInfAfterTheDoctor(at_step=3)])
    mp.prepare(model)
    _train(model, mp, _batches(4), torch.optim.SGD(model.parameters(), lr=0.1))
    assert doctor.replays == 1 and doctor.results[0].step == 3


def test_replay_doctor_replays_on_a_replay_event_and_close_removes_its_hooks() -> None:
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    _train(model, mp, _batches(2), torch.optim.SGD(model.parameters(), lr=0.1))
    doctor = mp.doctor
    doctor.on_event(mp, HookEvent(kind="other", reason="ignored"))
    assert doctor.findings == []
    doctor.on_event(mp, HookEvent(kind="replay", reason="SCALE_COLLAPSE", step=mp.optimizer_steps))
    assert [f.code for f in doctor.findings][:1] == ["SCALE_COLLAPSE"]
    assert doctor.findings[0].evidence["cause"] == "not_reproduced"
    doctor.close()
    assert doctor.hooks.roots == {} and not model._forward_pre_hooks and not model._forward_hooks


def test_replay_scale_collapse_from_a_derivative_singularity_says_so() -> None:
    model = dm.PairDistance(d_in=8)
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True)
    mp.prepare(model)
    mp.doctor.max_replays = 0  # only the explicit replay below
    _train(model, mp, _batches(1), torch.optim.SGD(model.parameters(), lr=0.01))
    found = mp.doctor.replay(reason="SCALE_COLLAPSE")
    (collapse,) = [f for f in found if f.code == "SCALE_COLLAPSE"]
    assert collapse.evidence["cause"] == "gradient_singularity"
    assert "overflows at any scale" in collapse.message


def test_live_doctor_non_scalar_loss_with_a_gradient_is_checked_and_replayed() -> None:
    # mp.backward(out, gradient=...) on a non-scalar output: the doctor must check every element.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True)
    mp.prepare(model)
    skipped = []
    for i in range(3):
        with mp.autocast():
            out = model(torch.randn(2, 4) * (1e6 if i == 1 else 1.0))
        mp.backward(out.float(), gradient=torch.ones(2, 3))
        skipped.append(mp.step(optimizer).skipped)
    assert skipped[1] and not skipped[2]
    assert mp.doctor is not None and "CAST_OVERFLOW" in {f.code for f in mp.doctor.findings}


def test_replay_of_an_applied_nan_step_names_the_data_once(caplog: pytest.LogCaptureFixture) -> None:
    # skip_nonfinite=False: the optimizer applies step 2's NaN gradients, so steps 3 and 4 fail because of it.
    model = _mlp()
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True, skip_nonfinite=False)
    mp.prepare(model)
    with caplog.at_level("WARNING", logger="ampkit.doctor"):
        _train(model, mp, _batches(4, nan_at=1), torch.optim.SGD(model.parameters(), lr=0.1))
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())  # the step was applied
    (f,) = mp.doctor.findings
    assert (f.code, f.step, f.module) == ("NONFINITE_INPUT", 2, "0")
    assert f.evidence["nan_rows"] == [1]
    assert f.evidence["consequence_steps"] == [3, 4]
    assert len([r for r in caplog.records if "NONFINITE_INPUT" in r.getMessage()]) == 1


def test_replay_after_an_applied_update_reports_the_non_finite_weights_once_and_says_why() -> None:
    # A loop doctor whose optimizer it does not hook decides at the step's end, after the update, as on an
    # accelerator: the replay of step 2 runs on the weights that step's NaN gradients already reached.
    from ampkit.integrations._doctor import LoopDoctor

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doctor = LoopDoctor(model, "bf16")
    for step, x in enumerate(_batches(3, nan_at=1), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        doctor.record_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        doctor.step_end(step, None, None)
    doctor.close()
    weights = [f for f in doctor.findings if f.evidence.get("kind") == "parameter"]
    assert len(weights) == 1 and weights[0].step == 2 and weights[0].evidence["weights"] == "after_update"
    assert weights[0].evidence["parameters"] == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert "after that step's update" in weights[0].message
    assert not any("an earlier step" in f.message for f in doctor.findings)
    assert {f.step for f in doctor.findings} == {2}
