"""Section ``frameworks``: the Hugging Face Trainer's fp16 path with ``ampkit.integrations.hf.AmpkitCallback``.

* ``scale_round_trip``: a run saves a checkpoint at step 4; a second Trainer resumes from it; the
  callback's ``resumed`` record must show the loss scale it saved.
* ``skip_backoff``: with fused AdamW and no clipping, an inf gradient injected at the LM head on the
  3rd training step must give a skipped telemetry record whose scale backs off, and, since the
  Trainer's schedule still advances on that step (Accelerate cannot see a fused optimizer's skip,
  accelerate#4242), a SCHEDULER_STEPPED_ON_SKIP warning.

On CUDA, ``fp16=True`` makes Accelerate build a real GradScaler.  On the CPU (the tests) Accelerate
builds none, so the accelerator is given a ``torch.amp.GradScaler("cpu")`` before training, as the
integration tests do.  The model is a 2-layer GPT-2 from a config (nothing is downloaded) at both sizes:
what is checked is the Trainer's step path, not speed.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpucheck.checks import Check, check, skipped

__all__ = ["run"]


def _trainer(out: Path, callback: Any, steps: int, device: torch.device, **kw: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(32)]
    on_cpu = device.type == "cpu"
    args = TrainingArguments(str(out), fp16=not on_cpu, use_cpu=on_cpu, max_steps=steps, per_device_train_batch_size=4,
                             report_to=[], logging_strategy="no", disable_tqdm=True, optim="adamw_torch_fused",
                             seed=0, **{"save_strategy": "no", **kw})
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[callback])
    if on_cpu:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return trainer


def scale_round_trip(device: torch.device, tmp: Path) -> Check:
    from ampkit.integrations.hf import AmpkitCallback

    _trainer(tmp, AmpkitCallback(), 4, device, save_strategy="steps", save_steps=4).train()
    cb = AmpkitCallback()
    _trainer(tmp, cb, 6, device).train(resume_from_checkpoint=str(tmp / "checkpoint-4"))
    resumed = cb.resumed or {}
    lost = [f.code for f in cb.findings if f.code == "CHECKPOINT_MISSING_SCALER"]
    ok = bool(resumed) and resumed.get("saved_scale") == resumed.get("scale") and not lost
    return check("frameworks.scale_round_trip", "Trainer resume", ok,
                 f"saved scale {resumed.get('saved_scale')}, resumed scale {resumed.get('scale')}"
                 + (f"; {lost[0]}" if lost else ""), resumed=resumed)


def skip_backoff(device: torch.device, tmp: Path) -> Check:
    from ampkit.integrations.hf import AmpkitCallback
    from ampkit.telemetry import Telemetry

    records: list[dict[str, Any]] = []
    cb = AmpkitCallback(telemetry=Telemetry(sinks=[records.append], flush_every=2))
    run = _trainer(tmp, cb, 6, device, max_grad_norm=0.0)
    calls = [0]

    def count(*_: Any) -> None:
        if torch.is_grad_enabled():
            calls[0] += 1

    run.model.transformer.ln_f.register_forward_hook(count)
    run.model.lm_head.register_full_backward_pre_hook(lambda m, g: (g[0] * math.inf,) if calls[0] == 3 else None)
    run.train()
    skips = [r for r in records if r["skipped"]]
    backed_off = bool(skips) and skips[0]["next_scale"] < skips[0]["scale"]
    codes = sorted({f.code for f in cb.findings if f.severity == "warning"})
    ok = backed_off and "SCHEDULER_STEPPED_ON_SKIP" in codes
    where = (f"step {skips[0]['step']} skipped, scale {skips[0]['scale']:g} -> {skips[0]['next_scale']:g}"
             if skips else f"no skipped record in {len(records)} records")
    return check("frameworks.skip_backoff", "fused AdamW skip", ok, f"{where}; warnings {codes}",
                 records=len(records), warnings=codes)


def run(device: torch.device, *, tiny: bool) -> Iterator[Check]:
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        for name in ("scale_round_trip", "skip_backoff"):
            yield skipped(f"frameworks.{name}", name, f"needs {' and '.join(missing)} (pip install 'ampkit[hf]')")
        return
    for fn in (scale_round_trip, skip_backoff):
        with tempfile.TemporaryDirectory(prefix="ampkit-gpu-check-hf-") as tmp:
            yield fn(device, Path(tmp))
