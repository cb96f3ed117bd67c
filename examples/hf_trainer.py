"""A Hugging Face Trainer run observed by ampkit: telemetry records, setup-check findings, alarms.

    pip install 'ampkit[hf]'
    python examples/hf_trainer.py

A 2-layer GPT-2 built from a config (nothing is downloaded), 10 optimizer steps on CPU.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ampkit.integrations.hf import AmpkitCallback
from ampkit.telemetry import Telemetry


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # ~0.2 M parameters
    rows = [torch.randint(0, 256, (32,)) for _ in range(80)]
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    records: list[dict] = []
    callback = AmpkitCallback(telemetry=Telemetry(sinks=[records.append], flush_every=5))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, use_cpu=True, max_steps=10, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    for r in records:
        print(f"step {r['step']:2d}  loss {r['loss']:.3f}  grad_norm {r['grad_norm']:.3f}  skipped {r['skipped']}")
    for f in callback.findings:
        print(f"{f.severity}: {f.code}: {f.message}")
    print(f"{len(records)} records, {len(callback.findings)} findings")


if __name__ == "__main__":
    main()
