"""Trainer-level fp16 checks of the Hugging Face integration on CUDA (where Accelerate makes a real GradScaler).

    python benchmarks/gpu/check_integrations_cuda.py

Checks, each a function: the loss scale survives a checkpoint round trip; an injected fp16 overflow
with fused AdamW gives a skipped record and a scale backoff; the Trainer's schedule advancing on that
skip gives SCHEDULER_STEPPED_ON_SKIP (accelerate#4242). Exits 0 with a message when there is no CUDA.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _trainer(out: Path, callback: Any, steps: int, **kw: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(32)]
    args = TrainingArguments(str(out), fp16=True, max_steps=steps, per_device_train_batch_size=4, report_to=[],
                             logging_strategy="no", disable_tqdm=True, optim="adamw_torch_fused",
                             **{"save_strategy": "no", **kw})
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                   callbacks=[callback])


def check_scale_round_trip(tmp: Path) -> None:
    from ampkit.integrations.hf import AmpkitCallback

    _trainer(tmp, AmpkitCallback(), 4, save_strategy="steps", save_steps=4).train()
    cb = AmpkitCallback()
    _trainer(tmp, cb, 6).train(resume_from_checkpoint=str(tmp / "checkpoint-4"))
    assert cb.resumed is not None and cb.resumed["saved_scale"] == cb.resumed["scale"], cb.resumed
    assert "CHECKPOINT_MISSING_SCALER" not in [f.code for f in cb.findings]
    print(f"ok: scale round trip {cb.resumed}")


def check_skip_backoff_and_scheduler(tmp: Path) -> None:
    from ampkit.integrations.hf import AmpkitCallback
    from ampkit.telemetry import Telemetry

    records: list[dict] = []
    cb = AmpkitCallback(telemetry=Telemetry(sinks=[records.append], flush_every=2))
    run = _trainer(tmp, cb, 6, max_grad_norm=0.0)
    calls = [0]

    # the 3rd training forward's backward gets an inf gradient at the LM head: an fp16 overflow
    run.model.transformer.ln_f.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    run.model.lm_head.register_full_backward_pre_hook(lambda m, g: (g[0] * math.inf,) if calls[0] == 3 else None)
    run.train()
    skipped = [r for r in records if r["skipped"]]
    assert skipped and skipped[0]["next_scale"] < skipped[0]["scale"], records
    codes = [f.code for f in cb.findings if f.severity == "warning"]
    assert "SCHEDULER_STEPPED_ON_SKIP" in codes, codes
    print(f"ok: skipped step {skipped[0]['step']} backed the scale off "
          f"{skipped[0]['scale']:g} -> {skipped[0]['next_scale']:g}; SCHEDULER_STEPPED_ON_SKIP fired")


def main() -> int:
    if not torch.cuda.is_available():
        print("skipped: no CUDA device (these checks need Accelerate's CUDA GradScaler)")
        return 0
    for check in (check_scale_round_trip, check_skip_backoff_and_scheduler):
        with tempfile.TemporaryDirectory() as tmp:
            check(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
