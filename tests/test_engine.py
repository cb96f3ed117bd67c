"""Engine behaviour: accumulation, several losses and optimizers, scheduler helper, guards."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

import ampkit
from tests.helpers.models import TinyNet, make_batches


def forward_loss(mp: ampkit.MixedPrecision, model, batch) -> torch.Tensor:
    x, y = batch
    with mp.autocast():
        return F.cross_entropy(model(x), y)


def test_engine_step_is_noop_until_accumulation_boundary(seed) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=3)
    before = copy.deepcopy(model.state_dict())
    boundaries = []
    for i, batch in enumerate(make_batches(6, seed=seed)):
        mp.backward(forward_loss(mp, model, batch))
        result = mp.step(opt)
        boundaries.append(result.boundary)
        if i == 1:
            assert torch.equal(model.fc1.weight, before["fc1.weight"])
            assert model.fc1.weight.grad is not None, "gradients accumulate between boundaries"
    assert boundaries == [False, False, True, False, False, True]
    assert mp.optimizer_steps == 2 and mp.micro_step == 0
    assert model.fc1.weight.grad is None, "zero_grad(set_to_none=True) runs at the boundary"


def test_engine_accumulation_averages_micro_batch_gradients(seed) -> None:
    model = TinyNet()
    batches = make_batches(4, seed=seed)
    mp = ampkit.MixedPrecision("fp32", device="cpu", grad_accumulation=4)
    captured = {}

    class Capture(ampkit.EngineHook):
        def before_optimizer_step(self, engine, optimizers, found_inf, grad_norm):
            captured["grad"] = model.fc2.weight.grad.clone()

    mp.add_hook(Capture())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for b in batches:
        mp.backward(forward_loss(mp, model, b))
        mp.step(opt)
    twin = copy.deepcopy(model)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(twin(x), y).backward()
    torch.testing.assert_close(captured["grad"], twin.fc2.weight.grad, rtol=1e-5, atol=1e-7)


def test_engine_several_losses_and_optimizers_in_one_step(seed) -> None:
    gen, disc = TinyNet(8, 16, 16), TinyNet(16, 16, 1)
    opt_g = torch.optim.AdamW(gen.parameters(), lr=1e-3, fused=True)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=1e-3)
    # A small init scale: the disc's bias gradient is 4 x 0.25 x scale, which overflows fp16 at 2^16.
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=2.0**10))
    w_g, w_d = gen.fc1.weight.clone(), disc.fc1.weight.clone()
    z = torch.randn(4, 8)
    with mp.autocast():
        fake = gen(z)
        loss_d = disc(fake.detach()).float().mean()
        loss_g = -disc(fake).float().mean()
    mp.backward(loss_d)
    mp.backward(loss_g)
    result = mp.step([opt_g, opt_d])
    assert result.applied
    assert not torch.equal(gen.fc1.weight, w_g) and not torch.equal(disc.fc1.weight, w_d)


def test_engine_result_reports_unscaled_grad_norm(seed) -> None:
    model = TinyNet()
    twin = copy.deepcopy(model)
    batch = make_batches(1, seed=seed)[0]
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    mp.backward(forward_loss(mp, model, batch))
    result = mp.step(torch.optim.SGD(model.parameters(), lr=0.0))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(twin(batch[0]), batch[1])
    loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()]))
    assert result.scale is not None and float(result.scale) == 2.0**16
    torch.testing.assert_close(result.grad_norm, expected, rtol=1e-3, atol=0)


def test_engine_scheduler_helper_skips_lr_on_skipped_steps_without_torch_warning(seed) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=ampkit.DynamicLossScaler(init_scale=2.0**40))
    advanced = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        for batch in make_batches(30, seed=seed):
            mp.backward(forward_loss(mp, model, batch))
            result = mp.step(opt)
            advanced.append(mp.scheduler_step(sched, result))
    assert not advanced[0], "the first step at scale 2^40 is skipped; the LR must not move"
    applied = sum(advanced)
    assert 0 < applied < 30
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5**applied)


def test_engine_backward_inside_autocast_warns_once(seed) -> None:
    model = TinyNet()
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in make_batches(3, seed=seed):
            with mp.autocast():
                loss = F.cross_entropy(model(batch[0]), batch[1])
                mp.backward(loss)
    messages = [str(w.message) for w in caught if "inside mp.autocast()" in str(w.message)]
    assert len(messages) == 1 and "move the backward call out" in messages[0]


def test_engine_guard_low_precision_params_with_fp16_scaling() -> None:
    model = TinyNet().half()
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    with pytest.raises(TypeError, match=r"trainable fp16 parameter.*fp32 master weights.*drop model\.half\(\)"):
        mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match="LOW_PRECISION_PARAMS"):
        mp.step(opt)


def test_engine_guard_model_on_another_device() -> None:
    model = TinyNet().to("meta")
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    with pytest.raises(RuntimeError, match=r"meta device.*model\.to_empty\(device='cpu'\)"):
        mp.prepare(model)


def test_engine_guard_optimizer_eps_not_representable() -> None:
    model = TinyNet().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler="none")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"Adam\(eps=1e-08\) cannot be represented in fp16.*becomes 0.*eps >= 6\.1"):
        mp.step(opt)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"grad_accumulation": 0}, ValueError, "grad_accumulation=0"),
     ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm=-1.0"),
     ({"scaler": "sometimes"}, ValueError, "dynamic"),
     ({"scaler": torch.amp.GradScaler("cpu")}, TypeError, "load_state_dict")],
)
def test_engine_rejects_bad_arguments(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        ampkit.MixedPrecision("fp16", device="cpu", **kwargs)


def test_engine_step_rejects_non_optimizer() -> None:
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        mp.step(TinyNet())  # type: ignore[arg-type]


def test_engine_state_dict_refuses_other_precision() -> None:
    sd = ampkit.MixedPrecision("fp16", device="cpu").state_dict()
    with pytest.raises(ValueError, match="saved with precision='fp16'.*MixedPrecision\\('fp16'"):
        ampkit.MixedPrecision("bf16", device="cpu").load_state_dict(sd)


def test_engine_no_sync_only_inside_accumulation_window() -> None:
    entered = []

    class FakeDDP(torch.nn.Module):
        def no_sync(self):
            import contextlib

            entered.append(True)
            return contextlib.nullcontext()

    mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=2)
    with mp.no_sync(FakeDDP()):
        pass
    mp.micro_step = 1  # the next step is the boundary: gradients must be all-reduced
    with mp.no_sync(FakeDDP()):
        pass
    assert entered == [True]


def test_engine_skips_step_when_loss_is_nonfinite_but_gradients_are_finite() -> None:
    w = torch.nn.Parameter(torch.tensor([-2.0, 3.0]))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    loss = torch.log(w).sum()  # log(-2) is NaN, yet d/dw log(w) = 1/w is finite
    mp.backward(loss)
    assert torch.isfinite(w.grad).all()
    before = w.detach().clone()
    result = mp.step(opt)
    assert result.skipped
    assert torch.equal(w.detach(), before)
    mp.backward((w * w).sum())  # the flag does not leak into the next step
    assert mp.step(opt).applied


def test_engine_nonfinite_loss_and_gradients_together_still_skip_fused_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")  # inf loss *and* non-finite gradients in the same step
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    before = copy.deepcopy(model.state_dict())
    result = mp.step(opt)
    assert float(result.found_inf) == 1.0, "fused kernels skip only on found_inf == 1"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert float(opt.state_dict()["state"][0]["step"]) == 0.0
