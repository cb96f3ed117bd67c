"""No host sync between flushes: every way Python code reads a tensor on the host is forbidden."""

from __future__ import annotations

import pytest
import torch
from telemetry_helpers import batch, train_step

import ampkit
from ampkit.telemetry import CallbackSink, JsonlSink, Telemetry

# Each of these makes the host wait for the device (or reads a CPU tensor the way it would).
FORBIDDEN = ("item", "__bool__", "cpu", "tolist", "numpy", "__float__", "__int__", "__index__")


class ForbiddenSync(AssertionError):
    pass


def _forbid(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FORBIDDEN:
        def raiser(self: torch.Tensor, *args: object, _name: str = name, **kwargs: object) -> None:
            raise ForbiddenSync(f"Tensor.{_name} was called between flushes")

        monkeypatch.setattr(torch.Tensor, name, raiser)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_telemetry_no_host_sync_between_flushes(precision: str, tiny: torch.nn.Module, tmp_path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    n = 6
    records: list[dict] = []
    tel = Telemetry(sinks=[CallbackSink(records.append), JsonlSink(tmp_path / "t.jsonl")], flush_every=n,
                    module_absmax_every=2)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision(precision, device="cpu", telemetry=tel, clip_grad_norm=1.0, grad_accumulation=2)
    mp.prepare(tiny)
    batches = [batch() for _ in range(2 * n)]
    with monkeypatch.context() as patch:
        _forbid(patch)
        for i in range(2 * (n - 1)):  # N-1 optimizer steps of 2 micro-batches each
            train_step(mp, tiny, opt, *batches[i])
        with pytest.raises(ForbiddenSync):  # the guard is live: a real read is caught
            bool(torch.ones(()))
        assert records == [] and tel.pending == n - 1
    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> object:
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    for i in range(2 * (n - 1), 2 * n):  # the N-th step flushes
        train_step(mp, tiny, opt, *batches[i])
    assert len(reads) == 1, f"a flush must read the device exactly once, read {reads}"
    assert [r["step"] for r in records] == list(range(1, n + 1))
    assert all(r["module_grad_absmax"] for r in records[::2])
    tel.close()


def test_telemetry_nosync_guard_catches_the_sync_of_a_non_fused_optimizer(tiny: torch.nn.Module,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine documents one sync per step for optimizers that cannot skip by themselves;
    # the guard above must see it, or the test above proves nothing.
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, foreach=False)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=Telemetry(flush_every=50))
    mp.prepare(tiny)
    _forbid(monkeypatch)
    with pytest.raises(ForbiddenSync):
        train_step(mp, tiny, opt, *batch())
