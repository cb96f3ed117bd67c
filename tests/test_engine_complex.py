"""Engine and complex parameters: unscaled, checked and normed through their real and imaginary parts."""

from __future__ import annotations

import copy

import pytest
import torch

import ampkit
from ampkit.scaler import unscale_and_check_


class ComplexNet(torch.nn.Module):
    """A complex Linear layer and a real loss (|y|^2): autocast casts no complex tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3, dtype=torch.complex64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).abs().pow(2).mean()


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, dtype=torch.complex64, generator=g) for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_trains_complex_model_like_plain_fp32_loop(precision, seed) -> None:
    model = ComplexNet()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0, telemetry=True)
    losses = []
    for x in _batches(5, seed):
        with mp.autocast():
            loss = model(x)
        mp.backward(loss)
        result = mp.step(opt)
        assert result.applied
        losses.append(float(loss.detach()))
        twin_loss = twin(x)
        twin_loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        twin_opt.step()
        twin_opt.zero_grad()
        # bf16 autocast leaves complex matmuls in complex64, so the two runs are the same math.
        torch.testing.assert_close(loss, twin_loss, rtol=0, atol=0)
    mp.close()
    assert model.fc.weight.dtype is torch.complex64
    assert losses[-1] < losses[0]
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"{name} differs from the plain fp32 loop"


def test_engine_fp16_unscales_complex_grads_like_dividing_by_the_scale(seed) -> None:
    model = ComplexNet()
    twin = copy.deepcopy(model)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    seen: dict[str, torch.Tensor] = {}

    class Capture(ampkit.EngineHook):
        def before_optimizer_step(self, engine, optimizers, found_inf, grad_norm):
            seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
            seen["found_inf"], seen["grad_norm"] = found_inf.clone(), grad_norm.clone()

    mp.add_hook(Capture())
    x = _batches(1, seed)[0]
    scale = float(mp.scale)
    with mp.autocast():
        loss = model(x)
    mp.backward(loss)
    assert mp.step(torch.optim.SGD(model.parameters(), lr=0.0)).applied
    (twin(x) * scale).backward()
    for name, p in twin.named_parameters():
        assert seen[name].dtype is torch.complex64
        assert torch.equal(seen[name], p.grad / scale), f"{name}: unscaled gradient differs from grad / scale"
    assert float(seen["found_inf"]) == 0.0
    expected = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) / scale for p in twin.parameters()]))
    torch.testing.assert_close(seen["grad_norm"], expected)


@pytest.mark.parametrize("bad", [complex(float("inf"), 0.0), complex(0.0, float("nan"))])
def test_unscale_and_check_finds_nonfinite_real_or_imaginary_part(bad) -> None:
    grads = [torch.tensor([2 + 4j, bad], dtype=torch.complex64), torch.tensor([8.0])]
    found = unscale_and_check_(grads, torch.tensor(0.5), torch.zeros(()))
    assert float(found) == 1.0
    assert grads[0][0] == 1 + 2j and grads[1][0] == 4.0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_engine_skips_step_with_nonfinite_complex_grad(precision) -> None:
    model = ComplexNet()
    before = copy.deepcopy(model.state_dict())
    mp = ampkit.MixedPrecision(precision, device="cpu")
    with mp.autocast():
        loss = model(torch.ones(2, 4, dtype=torch.complex64))
    mp.backward(loss)
    model.fc.bias.grad[0] = complex(0.0, float("inf"))
    assert not mp.step(torch.optim.SGD(model.parameters(), lr=0.1)).applied
    for name, value in before.items():
        assert torch.equal(value, model.state_dict()[name]), f"{name} changed on a skipped step"
