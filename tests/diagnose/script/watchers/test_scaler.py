"""The GradScaler watcher."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit.diagnose.script.watchers.scaler import ScalerWatch
from ampkit.findings import Finding
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())


def test_doctor_observers_clip_after_unscale_is_clean_and_before_is_not() -> None:
    def loop(unscale_first: bool) -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    bad = observe(lambda: loop(False))
    good = observe(lambda: loop(True))
    assert [f.code for f in bad.state.ledger.findings()] == ["CLIP_BEFORE_UNSCALE"]
    assert good.state.ledger.findings() == []
    assert bad.state.iteration == good.state.iteration == 2


def _order_findings(loop: object) -> list[Finding]:
    def run() -> None:
        with contextlib.suppress(RuntimeError, AssertionError):
            loop()  # type: ignore[operator]

    return [f for f in observe(run).state.ledger.findings() if f.code == "UNSCALE_ORDER_ERROR"]


def _micro_batch(model: nn.Module, scaler: torch.amp.GradScaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()


def test_scaler_watch_update_on_a_micro_batch_is_an_order_error_with_the_accumulation_order() -> None:
    def end_of_batch(scaler: torch.amp.GradScaler) -> None:
        scaler.update()

    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for i in range(4):
            _micro_batch(model, scaler)
            if (i + 1) % 2 == 0:
                scaler.step(opt)
            end_of_batch(scaler)

    [finding] = _order_findings(loop)
    assert finding.evidence["variant"] == "accumulation" and finding.evidence["call"] == "scaler.update()"
    assert "if (i + 1) % accum_steps == 0:" in finding.fix and finding.step == 1
    assert finding.location is not None and "scaler.update()" in finding.evidence["source"]
    outer, inner = finding.evidence["call_chain"][-2:]
    assert outer.endswith(".loop()") and inner.endswith(".end_of_batch()")
    assert finding.evidence["raised_in"] == "training_step"
    assert "; where: training after 0 optimizer steps, outside any forward; call chain: " in finding.message


def test_scaler_watch_second_step_without_update_names_the_missing_update() -> None:
    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(3):
            _micro_batch(model, scaler)
            scaler.step(opt)
            opt.zero_grad()

    [finding] = _order_findings(loop)
    assert finding.evidence["variant"] == "missing_update" and finding.evidence["call"] == "scaler.step()"
    assert finding.step == 2 and "after 1 optimizer step," in finding.message


def test_scaler_watch_step_on_a_scaler_that_never_scaled_names_the_other_scaler() -> None:
    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler_a, scaler_b = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
        _micro_batch(model, scaler_a)
        scaler_b.step(opt)

    [finding] = _order_findings(loop)
    assert finding.evidence["variant"] == "other_scaler"
    assert "one scaler for every loss and optimizer" in finding.fix


def test_doctor_observers_scaler_records_how_it_was_built_and_why_it_is_off() -> None:
    def build() -> None:
        torch.amp.GradScaler("cpu")
        torch.amp.GradScaler("cpu", enabled=False)
        with pytest.warns(FutureWarning):
            torch.cuda.amp.GradScaler()

    infos = observe(build).state.scalers.infos
    assert [i.built_as for i in infos] == ["torch.amp.GradScaler", "torch.amp.GradScaler", "torch.cuda.amp.GradScaler"]
    cuda_off = None if torch.cuda.is_available() else "no_cuda"
    assert [i.off_reason() for i in infos] == [None, "enabled_false", cuda_off]


def test_scaler_watch_alone_records_the_scaler_and_fails_a_skipped_step() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watching(ScalerWatch) as w:
        line = sys._getframe().f_lineno + 1
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for x in (torch.ones(1, 2), torch.full((1, 2), float("inf"))):
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
        w.state.pending.flush()
    [info] = w.state.scalers.infos
    assert (info.location, info.built_as, info.init_scale, info.used) == (f"{HERE}:{line}", "torch.amp.GradScaler",
                                                                          1024.0, 2)
    assert [s for _, s in info.scales] == [1024.0, 512.0]
    assert w.state.steps == 2 and w.state.skips == {2: "nonfinite_data"}
    assert [(f.kind, f.step, f.cause) for f in w.failures] == [("skip", 2, "nonfinite_data")]


def test_scaler_watch_alone_reports_clipping_and_a_direct_step_on_scaled_gradients() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watching(ScalerWatch) as w:
        scaler = torch.amp.GradScaler("cpu")
        scaled = scaler.scale(model(torch.ones(1, 2)).sum())
        assert w.state.scalers.scaled_source(scaled) is not None  # the backward watcher's question
        scaled.backward()
        line = sys._getframe().f_lineno + 1
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    found = {f.code: f for f in w.state.ledger.findings()}
    assert set(found) == {"CLIP_BEFORE_UNSCALE", "UNSCALE_ORDER_ERROR"}
    assert found["CLIP_BEFORE_UNSCALE"].location == f"{HERE}:{line}"
    assert found["CLIP_BEFORE_UNSCALE"].evidence["function"] == "clip_grad_norm_"
    assert found["UNSCALE_ORDER_ERROR"].location == f"{HERE}:{line + 1}"
    assert w.state.scalers.direct_steps == 1


def test_scaler_watch_writes_nothing_on_the_exception_it_explains() -> None:
    raised: list[BaseException] = []

    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        _micro_batch(model, scaler)
        scaler.step(opt)
        try:
            scaler.step(opt)  # a second step before update(): GradScaler's own order error
        except (RuntimeError, AssertionError) as exc:
            raised.append(exc)

    ctx = observe(loop)
    [exc] = raised
    assert [name for name in vars(exc) if name.startswith("_ampkit")] == []
    assert ctx.state.explained is exc
    assert [f.code for f in ctx.state.ledger.findings()] == ["UNSCALE_ORDER_ERROR"]
