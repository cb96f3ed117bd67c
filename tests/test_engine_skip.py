"""A skipped step leaves parameters and optimizer state bitwise untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import ampkit
from tests.helpers.models import TinyNet, make_batches

N_STEPS = 6


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def untouched(before: tuple[dict, dict], after: tuple[dict, dict]) -> bool:
    """Weights equal; pre-existing optimizer state equal.

    A fused optimizer whose very first step is skipped still creates its state lazily inside
    ``step()`` (the kernel then skips the update): that new state must be a fresh init — zeros
    and step 0 — i.e. nothing was learned from the bad gradients.
    """
    (w0, o0), (w1, o1) = before, after
    if not states_equal(w0, w1) or not states_equal(o0["param_groups"], o1["param_groups"]):
        return False
    for key, state in o1["state"].items():
        if key in o0["state"]:
            if not states_equal(o0["state"][key], state):
                return False
        elif not all(torch.count_nonzero(t) == 0 for t in state.values() if isinstance(t, torch.Tensor)):
            return False
    return o0["state"].keys() <= o1["state"].keys()


def states_equal(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    precision=st.sampled_from(["fp16", "bf16", "fp32"]),
    optimizer=st.sampled_from(["adamw-fused", "adamw", "sgd-momentum"]),
    bad_steps=st.sets(st.integers(0, N_STEPS - 1), min_size=1, max_size=3),
    data=st.data(),
)
def test_engine_skipped_steps_leave_everything_untouched(precision, optimizer, bad_steps, data) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    params = list(model.parameters())
    if optimizer == "sgd-momentum":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, fused=optimizer == "adamw-fused")
    mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0)
    mp.prepare(model)
    for step, (x, y) in enumerate(make_batches(N_STEPS, seed=1)):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        before = snapshot(model, opt)
        if step in bad_steps:
            victim = params[data.draw(st.integers(0, len(params) - 1), label="param")]
            assert victim.grad is not None
            flat = victim.grad.view(-1)
            index = data.draw(st.integers(0, flat.numel() - 1), label="element")
            flat[index] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
        result = mp.step(opt)
        after = snapshot(model, opt)
        if step in bad_steps:
            assert result.skipped
            assert untouched(before, after), f"skipped step {step} changed the model or optimizer state"
        else:
            assert result.applied
            assert not states_equal(before[0], after[0]), f"applied step {step} did not change the weights"


def _step_with_grad(mp: ampkit.MixedPrecision, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    value: float | None) -> ampkit.StepResult:
    """One step whose ``fc1.weight`` gradient element 0 is set to ``value`` (None: untouched)."""
    x, y = make_batches(1, seed=3)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    if value is not None:
        model.fc1.weight.grad.view(-1)[0] = value
    return mp.step(opt)


def test_engine_without_scaler_reads_found_inf_off_the_norm_in_one_pass(monkeypatch) -> None:
    calls = []
    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a: calls.append(1) or unscale(*a))
    for clip in (1.0, None):
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        mp = ampkit.MixedPrecision("bf16", device="cpu", clip_grad_norm=clip)
        mp.prepare(model)
        assert _step_with_grad(mp, model, opt, None).applied
        before = snapshot(model, opt)
        assert _step_with_grad(mp, model, opt, float("nan")).skipped, f"clip_grad_norm={clip}"
        assert untouched(before, snapshot(model, opt))
    assert calls == [], "without a loss scaler the clip's norm is the non-finite check: no second pass"


def test_engine_without_scaler_keeps_a_verdict_per_optimizer() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt_1 = torch.optim.SGD([model.fc1.weight, model.fc1.bias], lr=0.1)
    opt_2 = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("fc1.")], lr=0.1)
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    mp.prepare(model)
    w_1, w_2 = model.fc1.weight.clone(), model.fc2.weight.clone()
    x, y = make_batches(1, seed=3)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    model.fc1.weight.grad.view(-1)[0] = float("inf")
    result = mp.step([opt_1, opt_2])
    assert result.skipped
    assert torch.equal(model.fc1.weight, w_1), "the optimizer with the inf gradient skips"
    assert not torch.equal(model.fc2.weight, w_2), "the other one still steps"


def test_engine_fp16_params_without_scaler_apply_a_step_whose_norm_overflows_fp16() -> None:
    # fp16 gradients whose norm (above 65504) overflows while every element is finite: the norm is not
    # the check there, and the step is applied.
    torch.manual_seed(0)
    model = TinyNet().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mp = ampkit.MixedPrecision("fp32", device="cpu", scaler="none")
    mp.prepare(model)
    x, y = make_batches(1, seed=3)[0]
    mp.backward(F.cross_entropy(model(x.half()).float(), y))
    model.fc1.weight.grad.fill_(60000.0)
    result = mp.step(opt)
    assert result.grad_norm is not None and not torch.isfinite(result.grad_norm)
    assert result.applied


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_step_with_no_backward_before_it_is_refused_and_changes_nothing(precision: str) -> None:
    # GradScaler raises "No inf checks were recorded for this optimizer" here; the engine refuses
    # in every precision, before the optimizer, the step count or the scale move.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mp = ampkit.MixedPrecision(precision, device="cpu")
    mp.prepare(model)
    before = [p.detach().clone() for p in model.parameters()]
    scale = mp.scale.clone()
    with pytest.raises(RuntimeError, match=r"mp.step\(SGD\) found no gradient on any parameter: call mp.backward"):
        mp.step(opt)
    assert mp.optimizer_steps == 0 and opt.state == {} and sched.last_epoch == 0
    assert torch.equal(mp.scale, scale) and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with mp.autocast():  # the engine still trains normally afterwards
        loss = model(torch.randn(3, 4)).float().sum()
    mp.backward(loss)
    assert mp.step(opt).optimizer_step == 1
