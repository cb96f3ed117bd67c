"""Training process for the kill -9 resume test.

    python resume_worker.py --steps N --out params.pt [--ckpt PATH] [--resume] [--hang] [--precision P]
                            [--reference params.pt --reference-steps M]

Trains a small fp16 model with dropout (RNG), gradient accumulation (mid-window saves) and a
fast-growing dynamic loss scale (scaler state), saving a checkpoint after every micro-batch when
--ckpt is given.  With --hang it keeps running after the last step so the test can SIGKILL it.
With --reference it first trains an uninterrupted run of --reference-steps micro-batches from a
fresh build (every RNG re-seeded) and writes it there: the run a resumed one must equal, without a
process of its own to start (each start imports torch and ampkit).
With an fp8 --precision (fp8, fp8-rowwise, fp8-rowwise-gw-hp) the model is wider (dims multiples of 16,
so its Linear layers convert) and has no loss scaler.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import ampkit


def dims(precision: str) -> tuple[int, int, int]:
    return (32, 64, 16) if precision.startswith("fp8") else (8, 16, 4)


def build(precision: str):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    d_in, d_hidden, d_out = dims(precision)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Dropout(0.2), nn.GELU(), nn.Linear(d_hidden, d_out))
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**10, growth_interval=3) if precision == "fp16" else None
    mp = ampkit.MixedPrecision(precision, device="cpu", grad_accumulation=2, clip_grad_norm=1.0, scaler=scaler)
    model = mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return model, opt, sched, mp


def train(precision: str, steps: int, out: str, ckpt: str | None = None, resume: bool = False) -> None:
    """Train ``steps`` micro-batches from a fresh build (or from ``ckpt`` when ``resume``); save the result to ``out``."""
    model, opt, sched, mp = build(precision)
    d_in, _, d_out = dims(precision)
    start = 0
    if resume:
        extra = ampkit.load_checkpoint(ckpt, model=model, optimizer=opt, engine=mp, scheduler=sched)
        start = int(extra["micro_batches_done"])
    for i in range(start, steps):
        # Data from the global RNGs, so a resumed run only matches if they were restored.
        x = torch.randn(4, d_in) + float(np.random.rand()) + random.random()
        y = torch.randint(0, d_out, (4,))
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        result = mp.step(opt)
        mp.scheduler_step(sched, result)
        if ckpt:
            ampkit.save_checkpoint(ckpt, model=model, optimizer=opt, engine=mp, scheduler=sched,
                                   extra={"micro_batches_done": i + 1})
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "engine": mp.state_dict(),
                "lr": sched.get_last_lr()}, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True, help="micro-batches to run in total")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--reference", help="first write an uninterrupted run of --reference-steps here")
    ap.add_argument("--reference-steps", type=int)
    args = ap.parse_args()
    if args.reference:
        train(args.precision, args.reference_steps, args.reference)
    train(args.precision, args.steps, args.out, args.ckpt, args.resume)
    print("done", flush=True)
    while args.hang:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
