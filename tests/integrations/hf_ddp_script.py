"""Run on every rank by torchrun: a 3-step Trainer run (DDP on gloo) with AmpkitCallback writing per-rank JSONL."""

from __future__ import annotations

import sys
from pathlib import Path

from hf_helpers import trainer

from ampkit.integrations.hf import AmpkitCallback

out = Path(sys.argv[1])
cb = AmpkitCallback(telemetry=str(out / "records.rank{rank}.jsonl"))
trainer(out / "trainer", callbacks=[cb], steps=3, ddp_backend="gloo").train()
