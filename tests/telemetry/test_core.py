"""The Telemetry hook (ampkit.telemetry.core): logged values equal values computed by hand from the
very gradients the optimizer saw, and no host sync happens between flushes."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest
import torch

import ampkit
from ampkit.telemetry import CallbackSink, JsonlSink, Telemetry

from .telemetry_helpers import FORBIDDEN, ForbiddenSync, batch, count_as_on_an_accelerator, train_step


class Capture(ampkit.EngineHook):
    """Copies what each step saw, to recompute every metric by hand."""

    def __init__(self) -> None:
        self.losses: list[list[float]] = [[]]
        self.grads: list[list[torch.Tensor]] = []
        self.found: list[float] = []
        self.scale_used: list[float] = []
        self.scale_next: list[float] = []

    def on_backward(self, engine: ampkit.MixedPrecision, loss: torch.Tensor) -> None:
        self.losses[-1].append(float(loss.detach()))

    def before_optimizer_step(self, engine: ampkit.MixedPrecision, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.grads.append([p.grad.detach().clone() for o in optimizers for g in o.param_groups
                           for p in g["params"] if p.grad is not None])
        self.found.append(float(found_inf))
        self.losses.append([])

    def after_step(self, engine: ampkit.MixedPrecision, result: ampkit.StepResult,
                   optimizers: Sequence[torch.optim.Optimizer]) -> None:
        assert result.scale is not None
        self.scale_used.append(float(result.scale))
        self.scale_next.append(float(engine.scale))


def _same(a: float, b: float, rel: float = 1e-5) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == pytest.approx(b, rel=rel, abs=1e-12)


def _run(precision: str, tiny: torch.nn.Module, steps: int, **engine_kw: object) -> tuple[list[dict], Capture]:
    capture, records = Capture(), []
    tel = Telemetry(sinks=[records.append], flush_every=4, alarms=(), zero_grads_every=1)
    opt = torch.optim.AdamW(tiny.parameters(), lr=2e-3, fused=True)
    mp = ampkit.MixedPrecision(precision, device="cpu", hooks=[capture], telemetry=tel, grad_accumulation=2,
                               **engine_kw)  # type: ignore[arg-type]
    mp.prepare(tiny)
    for _ in range(2 * steps):
        train_step(mp, tiny, opt, *batch())
    tel.close()
    return records, capture


def test_telemetry_values_match_hand_computation_with_skipped_fp16_steps(tiny: torch.nn.Module) -> None:
    # 2**22 overflows fp16 gradients: the first steps are skipped and back off, the later ones apply.
    records, cap = _run("fp16", tiny, steps=8, scaler=ampkit.DynamicLossScaler(init_scale=2.0**22))
    assert len(records) == 8
    skipped = [r["skipped"] for r in records]
    assert any(skipped) and not all(skipped), f"the run must mix skipped and applied steps: {skipped}"
    for i, (r, grads) in enumerate(zip(records, cap.grads)):
        numel = sum(g.numel() for g in grads)
        nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        zeros = sum(int((g == 0).sum()) for g in grads)
        norm = float(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])))
        assert r["step"] == i + 1
        assert r["nonfinite_grads"] == nonfinite
        assert r["zero_grad_fraction"] == zeros / numel
        assert r["skipped"] == (nonfinite > 0) == (cap.found[i] > 0)
        assert _same(r["grad_norm"], norm) or (math.isinf(norm) and not math.isfinite(r["grad_norm"]))
        assert r["clip_coef"] == 1.0
        assert r["loss"] == pytest.approx(sum(cap.losses[i]) / len(cap.losses[i]), rel=1e-6)
        assert len(cap.losses[i]) == 2 and r["loss_nonfinite"] is False
        assert r["scale"] == cap.scale_used[i] and r["next_scale"] == cap.scale_next[i]
        assert r["lr"] == 2e-3 and r["rank"] == 0 and r["input_nonfinite"] is False
        if r["skipped"]:
            assert nonfinite > 0 and r["next_scale"] == r["scale"] / 2
    assert any(0 < r["zero_grad_fraction"] < 1 for r in records)  # the unused embedding rows


def test_telemetry_zero_count_on_sampled_steps_only(tiny: torch.nn.Module) -> None:
    capture, records = Capture(), []
    tel = Telemetry(sinks=[records.append], flush_every=4, alarms=(), zero_grads_every=3)
    opt = torch.optim.AdamW(tiny.parameters(), lr=2e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", hooks=[capture], telemetry=tel)
    mp.prepare(tiny)
    for _ in range(7):
        train_step(mp, tiny, opt, *batch())
    tel.close()
    assert [r["zero_grad_fraction"] is not None for r in records] == [True, False, False, True, False, False, True]
    for r in records[::3]:
        grads = capture.grads[r["step"] - 1]
        zeros = sum(int((g == 0).sum()) for g in grads)
        assert r["zero_grad_fraction"] == zeros / sum(g.numel() for g in grads) > 0
    assert all(r["nonfinite_grads"] == 0 for r in records)  # counted on every step
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="zero_grads_every"):
            Telemetry(zero_grads_every=bad)  # type: ignore[arg-type]


class _PoisonGrad:
    """A gradient hook that writes inf and NaN into one parameter's gradient on chosen calls."""

    def __init__(self, bad_calls: set[int]) -> None:
        self.bad_calls, self.calls = bad_calls, 0

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls not in self.bad_calls:
            return g
        g = g.clone()
        g.view(-1)[:3] = torch.tensor([math.inf, math.nan, -math.inf])
        return g


def _poisoned_run(tiny: torch.nn.Module, *extra_hooks: ampkit.EngineHook) -> tuple[list[dict], Capture, list[int]]:
    capture, records = Capture(), []
    tel = Telemetry(sinks=[records.append], flush_every=3, alarms=(), zero_grads_every=0)
    opt = torch.optim.AdamW(tiny.parameters(), lr=2e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", hooks=[capture], telemetry=tel)
    for hook in extra_hooks:
        mp.add_hook(hook)  # after the telemetry: it sees the gradients the telemetry noted
    mp.prepare(tiny)
    tiny.body[2].weight.register_hook(_PoisonGrad({3}))
    passes: list[int] = []
    count = tel._grad_counts.counter.count

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        passes.append(capture_step[0])
        return count(*args, **kwargs)  # type: ignore[arg-type]

    tel._grad_counts.counter.count = counted  # type: ignore[method-assign]
    capture_step = [0]
    for i in range(5):
        capture_step[0] = i + 1
        train_step(mp, tiny, opt, *batch())
    tel.close()
    return records, capture, passes


def test_telemetry_cpu_nonfinite_count_comes_off_the_norm_with_no_pass_on_finite_steps(tiny: torch.nn.Module) -> None:
    records, capture, passes = _poisoned_run(tiny)
    counts = [sum(int((~torch.isfinite(g)).sum()) for g in grads) for grads in capture.grads]
    assert counts == [0, 0, 3, 0, 0]
    assert [r["nonfinite_grads"] for r in records] == counts
    assert records[2]["skipped"] and not math.isfinite(records[2]["grad_norm"])
    assert passes == [3], "only the step whose norm is not finite reads the gradients again"


class _ClipByValue(ampkit.EngineHook):
    """Clips every gradient element into [-1, 1] after the unscale, as a user's own clipping hook may."""

    def after_unscale(self, engine: ampkit.MixedPrecision, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        torch.nn.utils.clip_grad_value_([p for o in optimizers for g in o.param_groups for p in g["params"]], 1.0)


def test_telemetry_cpu_nonfinite_count_not_measured_when_a_hook_changed_the_gradients(tiny: torch.nn.Module) -> None:
    # The clip turns +-inf into +-1 before the norm: counting now would report 1 (the NaN), not the 3 there were.
    records, _, _ = _poisoned_run(tiny, _ClipByValue())
    assert [r["nonfinite_grads"] for r in records] == [0, 0, None, 0, 0]


def test_telemetry_values_clip_coef_matches_torch_formula(tiny: torch.nn.Module) -> None:
    records, _ = _run("bf16", tiny, steps=6, clip_grad_norm=0.05)
    for r in records:
        assert math.isfinite(r["grad_norm"]) and not r["skipped"]
        expected = min(1.0, 0.05 / (r["grad_norm"] + 1e-6))
        assert r["clip_coef"] == pytest.approx(expected, rel=1e-6)
    assert any(r["clip_coef"] < 1.0 for r in records)


def test_telemetry_values_module_absmax_on_sampled_steps(tiny: torch.nn.Module) -> None:
    capture, records = Capture(), []
    extra = torch.nn.Parameter(torch.randn(3))  # optimised but owned by no prepared model
    tel = Telemetry(sinks=[records.append], flush_every=3, module_absmax_every=2, alarms=())
    opt = torch.optim.AdamW([*tiny.parameters(), extra], lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", hooks=[capture], telemetry=tel)
    mp.prepare(tiny)
    for _ in range(5):
        x, idx, y = batch()
        with mp.autocast():
            loss = (tiny(x, idx).float() - y).pow(2).mean() + extra.float().pow(2).sum()
        mp.backward(loss)
        mp.step(opt)
    tel.close()
    assert [("module_grad_absmax" in r) for r in records] == [True, False, True, False, True]
    owners = ["emb", "body.0", "body.0", "body.2", "body.2", "(unnamed)"]  # parameter order of the optimizer
    for r in records[::2]:
        grads = capture.grads[r["step"] - 1]
        expected: dict[str, float] = {}
        for owner, g in zip(owners, grads):
            expected[owner] = max(expected.get(owner, 0.0), float(g.abs().max()))
        assert r["module_grad_absmax"] == pytest.approx(expected, rel=1e-6)


def test_telemetry_values_lr_held_as_a_tensor(tiny: torch.nn.Module) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=2, alarms=())
    opt = torch.optim.AdamW(tiny.parameters(), lr=torch.tensor(3e-3), fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    for _ in range(2):
        train_step(mp, tiny, opt, *batch())
    assert [r["lr"] for r in records] == pytest.approx([3e-3, 3e-3])


def test_telemetry_values_records_are_plain_json(tiny: torch.nn.Module) -> None:
    records, _ = _run("fp16", tiny, steps=2, scaler=ampkit.DynamicLossScaler(init_scale=2.0**22))
    types = {"step": int, "rank": int, "loss": float, "loss_nonfinite": bool, "scale": float, "skipped": bool,
             "grad_norm": float, "clip_coef": float, "nonfinite_grads": int, "zero_grad_fraction": float,
             "lr": float, "next_scale": float, "input_nonfinite": bool}
    for r in records:
        assert {k: type(r[k]) for k in types} == types
        assert json.loads(json.dumps(r)).keys() == r.keys()


def test_telemetry_records_no_step_for_a_step_without_backward(tiny: torch.nn.Module) -> None:
    tel = Telemetry(flush_every=10, alarms=())
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    with pytest.raises(RuntimeError, match="found no gradient on any parameter"):
        mp.step(opt)  # no gradients at all: refused, as GradScaler refuses it
    assert tel.flush() == [] and mp.optimizer_steps == 0


class PreClipCapture(ampkit.EngineHook):
    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def after_unscale(self, engine: ampkit.MixedPrecision, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.grads.append([p.grad.detach().clone() for o in optimizers for g in o.param_groups
                           for p in g["params"] if p.grad is not None])


def test_telemetry_counts_gradients_before_clipping_on_skipped_steps(tiny: torch.nn.Module) -> None:
    capture, records = PreClipCapture(), []
    tel = Telemetry(sinks=[records.append], flush_every=4, alarms=(), zero_grads_every=1)
    opt = torch.optim.AdamW(tiny.parameters(), lr=2e-3, fused=True)
    mp = ampkit.MixedPrecision("fp16", device="cpu", hooks=[capture], telemetry=tel, clip_grad_norm=1.0,
                               scaler=ampkit.DynamicLossScaler(init_scale=2.0**22))
    mp.prepare(tiny)
    for _ in range(8):
        train_step(mp, tiny, opt, *batch())
    tel.close()
    skipped = [r for r in records if r["skipped"]]
    assert skipped, "2**22 must overflow the first fp16 steps"
    for r, grads in zip(records, capture.grads):
        nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        assert r["nonfinite_grads"] == nonfinite
    numel = sum(p.numel() for p in tiny.parameters())
    assert all(r["nonfinite_grads"] < numel for r in skipped), "clipping's NaN coefficient must not be counted"


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
    count_as_on_an_accelerator(monkeypatch)
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
