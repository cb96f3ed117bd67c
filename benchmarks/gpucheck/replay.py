"""Section ``replay``: an injected fp16 overflow, replayed through the accelerator path, names the same culprit as on the CPU.

A three-layer model (``embed`` -> ``ffn`` -> ``head``) has constant weights chosen so that inputs
around 1e-4 give outputs around 1, and inputs of 100 make ``ffn``'s matmul exceed fp16's 65504.
The same steps run twice in this process, on ``MixedPrecision("fp16", doctor=True)`` on the device
and on a CPU copy: three ordinary steps, the overflowing step 4, then ordinary steps until the
doctor has decided.  On the device the doctor learns of the skip from a pinned-memory copy and an
event it polls at a later forward, so its replay comes a step or more later; on the CPU at once.
Pass: the first error finding of both replays has the same (code, module, op).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

import ampkit
from ampkit._util.speed import synchronize
from gpucheck.checks import Check, check

__all__ = ["Overflowing", "run"]

SIZES = {"full": (256, 1024, 32), "tiny": (4, 8, 2)}
"""(inputs, width, batch)."""
NORMAL, HUGE = 1e-4, 100.0


class Overflowing(nn.Module):
    def __init__(self, d_in: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, width)
        self.ffn = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.embed.weight.fill_(1.0)
            self.embed.bias.zero_()
            # ffn's output is c * width * d_in * mean(x): about 1 for inputs ~NORMAL, 2e6 for HUGE.
            self.ffn.weight.fill_(1.0 / (width * d_in * NORMAL / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.ffn(self.embed(x))))


def _batches(tiny: bool) -> list[torch.Tensor]:
    d_in, _, batch = SIZES["tiny" if tiny else "full"]
    g = torch.Generator().manual_seed(3)
    normal = [torch.rand(batch, d_in, generator=g) * NORMAL for _ in range(8)]
    return [*normal[:3], torch.full((batch, d_in), HUGE), *normal[3:]]


def _train(device: torch.device, tiny: bool) -> tuple[ampkit.MixedPrecision, int]:
    """Steps until the doctor has replayed the overflow; returns the engine and the steps run."""
    d_in, width, _ = SIZES["tiny" if tiny else "full"]
    torch.manual_seed(0)
    model = Overflowing(d_in, width).to(device)
    mp = ampkit.MixedPrecision("fp16", device=device, doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps = 0
    for x in _batches(tiny):
        if _culprit(mp) is not None:
            break
        synchronize(device)  # lets the previous step's flag land, so the next forward's poll finds it
        with mp.autocast():
            loss = model(x.to(device)).float().mean()
        mp.backward(loss)
        mp.step(opt)
        steps += 1
    return mp, steps


def _culprit(mp: ampkit.MixedPrecision) -> tuple[str | None, str | None, str | None] | None:
    assert mp.doctor is not None
    errors = [f for f in mp.doctor.findings if f.severity == "error"]
    return (errors[0].code, errors[0].module, errors[0].op) if errors else None


def run(device: torch.device, *, tiny: bool) -> Iterator[Check]:
    accel, accel_steps = _train(device, tiny)
    cpu, cpu_steps = _train(torch.device("cpu"), tiny)
    got, want = _culprit(accel), _culprit(cpu)
    assert accel.doctor is not None
    ok = got is not None and got == want
    detail = (f"{device.type}: {got} after {accel_steps} steps; cpu: {want} after {cpu_steps} steps"
              if got is not None else f"{device.type}: no error finding after {accel_steps} steps (cpu: {want})")
    yield check("replay.culprit", f"{device.type} replay vs cpu replay", ok, detail,
                device_culprit=list(got) if got else None, cpu_culprit=list(want) if want else None,
                device_steps=accel_steps, cpu_steps=cpu_steps,
                device_findings=[f.code for f in accel.doctor.findings])
