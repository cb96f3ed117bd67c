"""Lightning integration: ``AmpkitPrecision`` against stock Lightning and the hand-written recipe, ``AmpkitCallback``.

Every run is a real ``lightning.pytorch.Trainer`` on CPU with a 3-layer MLP and a few steps.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins import MixedPrecision as StockMixedPrecision  # noqa: E402

from ampkit.integrations.lightning import AmpkitCallback, AmpkitPrecision  # noqa: E402
from ampkit.scaler import DynamicLossScaler  # noqa: E402
from ampkit.telemetry import LossNonFiniteAlarm, Telemetry  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BATCH, BATCHES = 4, 8


class Tiny(pl.LightningModule):
    """A 3-layer MLP; ``inf_at`` writes an inf into one gradient at that optimizer step (an fp16 overflow)."""

    def __init__(self, *, fused: bool = False, scheduler: bool = False, inf_at: int | None = None,
                 nan_loss_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.fused, self.scheduler, self.inf_at, self.nan_loss_at = fused, scheduler, inf_at, nan_loss_at
        self.output_dtypes: list[torch.dtype] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.output_dtypes.append(out.dtype)
        loss = (out.float() - y).pow(2).mean()
        self.losses.append(loss.item())
        return loss * math.nan if batch_idx == self.nan_loss_at else loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.inf_at:
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(BATCH * BATCHES, 8, generator=g), torch.randn(BATCH * BATCHES, 1, generator=g))
    return DataLoader(data, batch_size=BATCH)


def _fit(model: Tiny, steps: int, *, ckpt_path: str | None = None, **trainer: Any) -> Any:
    t = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **trainer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|not resumable).*")
        t.fit(model, _loader(), ckpt_path=ckpt_path)
    return t


def _recipe(model: Tiny, steps: int, *, clip: float | None = None) -> torch.amp.GradScaler:
    """The official fp16 recipe by hand: autocast, GradScaler("cpu"), unscale_ + clip, step, update."""
    opt = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    for i, batch in enumerate(_loader()):
        if i == steps:
            break
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.training_step(batch, i)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_ampkit_precision_bf16_matches_stock_bitwise() -> None:
    stock, ours = Tiny(), Tiny()
    _fit(stock, 4, precision="bf16-mixed")
    _fit(ours, 4, plugins=[AmpkitPrecision("bf16-mixed")])
    assert set(ours.output_dtypes) == {torch.bfloat16}
    _assert_same_params(ours, stock)


def test_ampkit_precision_16_mixed_trains_fp16_with_scaling_like_the_recipe() -> None:
    ours, recipe = Tiny(), Tiny()
    plugin = AmpkitPrecision("16-mixed")
    trainer = _fit(ours, 6, plugins=[plugin])
    scaler = _recipe(recipe, 6)
    assert trainer.precision == "16-mixed"
    assert set(ours.output_dtypes) == {torch.float16}
    assert plugin.engine is not None and plugin.engine.scaler.enabled
    assert plugin.engine.scale.item() == scaler.get_scale()
    assert not torch.equal(ours.net[0].weight, Tiny().net[0].weight)  # some steps were applied
    _assert_same_params(ours, recipe)


def test_stock_16_mixed_on_cpu_runs_bf16_without_scaler() -> None:
    stock = Tiny()
    with pytest.warns(UserWarning, match="not supported on CPU") as caught:
        trainer = _fit(stock, 2, precision="16-mixed")
    assert len([w for w in caught if "not supported on CPU" in str(w.message)]) == 1
    assert set(stock.output_dtypes) == {torch.bfloat16}
    assert getattr(trainer.precision_plugin, "scaler", None) is None


def test_ampkit_precision_fused_optimizer_with_clipping_matches_recipe() -> None:
    ours, recipe = Tiny(fused=True), Tiny(fused=True)
    _fit(ours, 6, plugins=[AmpkitPrecision("16-mixed")], gradient_clip_val=0.5)
    _recipe(recipe, 6, clip=0.5)
    _assert_same_params(ours, recipe)


def test_stock_mixed_precision_refuses_fused_optimizer_with_clipping() -> None:
    stock = StockMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Tiny(fused=True), 2, plugins=[stock], gradient_clip_val=0.5)


def test_ampkit_precision_scheduler_not_stepped_on_skipped_step() -> None:
    records: list[dict[str, Any]] = []
    plugin = AmpkitPrecision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10),
                             telemetry=Telemetry([records.append], flush_every=1))
    trainer = _fit(Tiny(scheduler=True, inf_at=2), 5, plugins=[plugin])
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    # Stock Lightning, same loop with its own GradScaler: the schedule moves on the skipped step too.
    stock = StockMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = _fit(Tiny(scheduler=True, inf_at=2), 5, plugins=[stock])
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5


def test_ampkit_precision_checkpoint_restores_scale(tmp_path: Path) -> None:
    plugin = AmpkitPrecision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10))
    trainer = _fit(Tiny(inf_at=1), 3, plugins=[plugin])
    path = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["AmpkitPrecision"]["scaler"]["scale"] == 512.0

    seen: list[float] = []

    class ScaleAtStart(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.append(trainer.precision_plugin.engine.scale.item())

    resumed = AmpkitPrecision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10))
    _fit(Tiny(), 4, plugins=[resumed], callbacks=[ScaleAtStart()], ckpt_path=path)
    assert seen == [512.0]
    assert resumed.engine is not None and resumed.engine.optimizer_steps == 4


def test_ampkit_precision_keep_fp32_runs_module_in_fp32() -> None:
    model = Tiny()
    dtypes: dict[str, torch.dtype] = {}
    for name in ("0", "2"):
        model.net.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype))
    _fit(model, 1, plugins=[AmpkitPrecision("16-mixed", keep_fp32=["net.2"])])
    assert dtypes == {"0": torch.float16, "2": torch.float32}


class ManualTiny(Tiny):
    """Manual optimization: Lightning runs training_step (and so manual_backward) inside autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_ampkit_precision_manual_optimization_steps_through_the_engine() -> None:
    model, plugin = ManualTiny(), AmpkitPrecision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10))
    before = model.net[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inside mp.autocast.*")
        trainer = _fit(model, 3, plugins=[plugin])
    assert plugin.engine is not None and plugin.engine.optimizer_steps == trainer.global_step == 3
    assert set(model.output_dtypes) == {torch.float16}
    assert not torch.equal(model.net[0].weight, before)


def test_ampkit_precision_refuses_strategy_with_its_own_precision() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class DeepSpeedStrategy(SingleDeviceStrategy):  # detected by its class name, as the real one
        pass

    with pytest.raises(RuntimeError, match="does not run under DeepSpeedStrategy.*AmpkitCallback"):
        _fit(Tiny(), 1, plugins=[AmpkitPrecision("bf16-mixed")], strategy=DeepSpeedStrategy(device="cpu"))


def test_ampkit_callback_one_record_per_optimizer_step_without_changing_training() -> None:
    def stock() -> StockMixedPrecision:
        return StockMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))

    records: list[dict[str, Any]] = []
    watched, plain = Tiny(inf_at=1), Tiny(inf_at=1)
    _fit(watched, 3, plugins=[stock()], accumulate_grad_batches=2,
         callbacks=[AmpkitCallback(telemetry=Telemetry([records.append], flush_every=2))])
    _fit(plain, 3, plugins=[stock()], accumulate_grad_batches=2)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [(r["skipped"], r["scale"], r["next_scale"]) for r in records] == [
        (False, 1024.0, 1024.0), (True, 1024.0, 512.0), (False, 512.0, 512.0)]
    assert all(math.isfinite(r["loss"]) for r in records)
    _assert_same_params(watched, plain)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_ampkit_callback_records_each_step_with_its_own_loss_and_gradients(precision: str) -> None:
    # Without a scaler the stock plugins call optimizer.step(closure): forward and backward run inside the step.
    records: list[dict[str, Any]] = []
    model = Tiny()
    _fit(model, 3, precision=precision, callbacks=[AmpkitCallback(telemetry=Telemetry([records.append]))])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == pytest.approx(model.losses, rel=1e-6)
    assert all(r["grad_norm"] > 0 and r["nonfinite_grads"] == 0 for r in records)


def test_ampkit_callback_stop_alarm_ends_training() -> None:
    callback = AmpkitCallback(telemetry=Telemetry(flush_every=1, alarms=[LossNonFiniteAlarm(action="stop")]))
    trainer = _fit(Tiny(nan_loss_at=2), 8, callbacks=[callback])
    assert callback.stop_event is not None and callback.stop_event.alarm == "LOSS_NONFINITE"
    assert trainer.global_step == 3  # the batch whose step fired the alarm is the last one


class FindingsAtFirstBatch(pl.Callback):
    """Snapshots the AmpkitCallback's finding codes when the first batch starts (before step 1)."""

    def __init__(self, watched: AmpkitCallback) -> None:
        self.watched, self.codes = watched, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.codes is None:
            self.codes = [f.code for f in self.watched.findings]


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_ampkit_callback_setup_checks_reports_bf16_params_before_step_1(precision: str) -> None:
    model = Tiny()
    if precision == "bf16-mixed":
        model = model.to(torch.bfloat16)  # as if loaded from a bf16 checkpoint; "-true" converts it itself
    callback = AmpkitCallback()
    probe = FindingsAtFirstBatch(callback)
    _fit(model, 1, precision=precision, callbacks=[callback, probe])
    assert probe.codes == ["LOW_PRECISION_PARAMS"]
    assert callback.findings[0].evidence["dtypes"] == ["bf16"]


def test_ampkit_callback_setup_checks_quiet_for_fp32_params_under_bf16_mixed() -> None:
    callback = AmpkitCallback()
    probe = FindingsAtFirstBatch(callback)
    _fit(Tiny(), 1, precision="bf16-mixed", callbacks=[callback, probe])
    assert probe.codes == []


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogNet(pl.LightningModule):
    """training_step calls ``self(x)``; ``take_log`` of a negative input is NaN (every value finite before it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.take_log = Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.take_log(self.fc(x).abs() + x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float().mean()

    def configure_optimizers(self) -> Any:
        # lr 0: the NaN step leaves the weights as they were, so the replay runs the failing step's weights
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_ampkit_callback_doctor_replays_nonfinite_loss_step_and_names_the_module() -> None:
    x = torch.ones(6, 4)
    x[2:4] = -1e3  # the second batch: finite data whose log is NaN
    loader = DataLoader(TensorDataset(x), batch_size=2)
    callback = AmpkitCallback(doctor=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
                         callbacks=[callback])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec).*")
        trainer.fit(LogNet(), loader)
    nan = [f for f in callback.findings if f.code == "FORWARD_NAN"]
    assert nan and nan[0].module == "take_log" and nan[0].step == 2
    assert nan[0].evidence["replay_reason"] == "non-finite loss"


def test_ampkit_callback_refuses_ampkit_precision() -> None:
    with pytest.raises(ValueError, match="AmpkitPrecision"):
        _fit(Tiny(), 1, plugins=[AmpkitPrecision("bf16-mixed")], callbacks=[AmpkitCallback()])


def test_import_ampkit_loads_no_framework() -> None:
    code = ("import sys, ampkit, ampkit.integrations\nampkit.MixedPrecision\n"
            "assert not {'lightning', 'pytorch_lightning', 'transformers'} & set(sys.modules), sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_example_lightning_fit_runs() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_fit.py")], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped" in proc.stdout


class Standardize(nn.Module):
    """sqrt(E[x^2] - E[x]^2): for features around 300 the bf16 difference is rounding noise, often negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = (x * x).mean(dim=-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)


class StandardizeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.standardize = Standardize()
        self.head = nn.Linear(32, 2)
        with torch.no_grad():
            self.proj.bias.fill_(300.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.standardize(self.proj(x)))


class HoldsModel(pl.LightningModule):
    """Lightning's own example pattern: the module holds ``self.model`` and training_step calls ``self.model(x)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = StandardizeNet()
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x).float(), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # lr 0 and NaN gradients made 0: the weights stay the failing step's, so the replay sees where the NaN is born
        for p in self.parameters():
            p.grad = torch.nan_to_num(p.grad, nan=0.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_ampkit_callback_doctor_replays_training_step_that_calls_self_model(caplog: pytest.LogCaptureFixture) -> None:
    readings = 10.0 * torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(readings, (readings[:, 0] > 0).long()), batch_size=16)
    callback = AmpkitCallback(doctor=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
                         callbacks=[callback])
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="ampkit.doctor"):
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|LOSS_NONFINITE).*")
        trainer.fit(HoldsModel(), loader)
    assert not [r for r in caplog.records if "cannot be replayed" in r.getMessage()]
    nan = [f for f in callback.findings if f.code == "FORWARD_NAN"]
    assert nan and nan[0].module == "standardize" and nan[0].severity == "error" and nan[0].step == 1
    assert nan[0].evidence["replay_reason"] == "non-finite loss"


class Deep(pl.LightningModule):
    """Three Linear layers trained by SGD: a NaN in the data makes every weight NaN at its step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_ampkit_callback_doctor_reports_an_applied_nan_step_once_with_its_origin(
        caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g)
    x[5, 3] = math.nan  # row 1 of the second batch
    callback = AmpkitCallback(doctor=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
                         callbacks=[callback])
    module = Deep()
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="ampkit.doctor"):
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|LOSS_NONFINITE).*")
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    assert not all(bool(torch.isfinite(p).all()) for p in module.parameters())  # Lightning applied the NaN step
    doctor = [f for f in callback.findings if f.evidence.get("replay_reason")]
    assert [(f.code, f.step, f.module) for f in doctor] == [("NONFINITE_INPUT", 2, "model.0")]
    assert doctor[0].evidence["nan_rows"] == [1] and doctor[0].evidence["consequence_steps"] == [3]
    assert len([r for r in caplog.records if r.getMessage().startswith("ampkit doctor: step")]) == 1
