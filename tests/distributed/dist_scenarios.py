"""Distributed scenarios run on every rank by ``launch_torchrun`` (``python -m dist_scenarios``).

One launch runs many scenarios, so the suite pays the process start-up a few times only.
Each scenario writes ``<out>/<name>.rank<R>.pt`` (``torch.save`` of plain data); the tests in
this folder load and check them.  Phases:

* ``main``: every scenario, plus the uninterrupted references of the kill/resume test;
* ``kill``: train DDP and FSDP2 to step 10 and checkpoint, train FSDP2 on, then rank 1 is
  SIGKILLed in the middle of overwriting the FSDP2 checkpoint at step 13;
* ``resume``: both ranks restart from the step-10 checkpoints and train to step 20.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit
import ampkit.distributed as ad
from ampkit.tasks.gpt import GPT, GPTConfig

STEPS = 20
CKPT_STEP = 10
NAN_STEP = 7
KILL_STEP = 13
D_IN = 16


# -- models and data ----------------------------------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln(x)))))


class ResMLP(nn.Module):
    """Residual MLP regressor; its 1-row head leaves rank 1 of 2 with empty FSDP shards."""

    def __init__(self, d: int = 32, n_blocks: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList(ResBlock(d, dropout) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def regression_batch(step: int, global_batch: int, part: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (same on every rank), or rank ``part[0]`` of ``part[1]``'s slice."""
    g = torch.Generator().manual_seed(1_000_003 + step)
    x = torch.randn(global_batch, D_IN, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    if part is None:
        return x, y
    rank, world = part
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def text_tokens() -> torch.Tensor:
    import ampkit.tasks.gpt as gpt_module

    return torch.tensor(list(Path(gpt_module.__file__).read_bytes()), dtype=torch.long)


def gpt_batch(tokens: torch.Tensor, step: int, global_batch: int, block: int, part: tuple[int, int]):
    g = torch.Generator().manual_seed(7_000_001 + step)
    starts = torch.randint(0, tokens.numel() - block - 1, (global_batch,), generator=g)
    x = torch.stack([tokens[s:s + block] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + block + 1] for s in starts.tolist()])
    rank, world = part
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


# -- helpers ---------------------------------------------------------------------------------------
def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def seed_everything(scenario: str, per_rank: bool) -> None:
    base = sum(map(ord, scenario)) * 101
    torch.manual_seed(base + (rank() if per_rank else 0))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters on every rank (FSDP2: an all-gather per parameter), detached copies."""
    inner = model.module if isinstance(model, DDP) else model
    out = {}
    for name, p in inner.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def global_mean(values: list[torch.Tensor]) -> list[float]:
    t = torch.stack([v.detach().float() for v in values])
    dist.all_reduce(t)
    return (t / world()).tolist()


def save(out: Path, name: str, obj: dict[str, Any]) -> None:
    torch.save(obj, out / f"{name}.rank{rank()}.pt")
    print(f"scenario {name}: done", flush=True)


def fused_adamw(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)


def train_regression(
    model: nn.Module, opts: list[torch.optim.Optimizer], mp: ampkit.MixedPrecision, steps: range,
    *, global_batch: int = 8,
    poison_batch: Callable[[int, torch.Tensor], None] | None = None,
    poison_grads: Callable[[int], None] | None = None,
    watch_step: int | None = None,
    ctx: ad.DistributedContext | None = None,
) -> dict[str, Any]:
    """The ampkit loop; records losses, found_inf, scales, and what happened at ``watch_step``."""
    losses, found, scales = [], [], []
    watch: dict[str, Any] = {}
    for step in steps:
        x, y = regression_batch(step, global_batch, (rank(), world()))
        if poison_batch is not None:
            poison_batch(step, x)
        with mp.no_sync(model):
            with mp.autocast():
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            mp.backward(loss)
        if poison_grads is not None:
            poison_grads(step)
        before = full_params(model) if step == watch_step else None
        result = mp.step(opts)
        losses.append(loss.detach())
        found.append(result.found_inf.detach().clone())
        scales.append(result.scale.detach().clone())
        if before is not None:
            after = full_params(model)
            watch["unchanged"] = {name: torch.equal(before[name], after[name]) for name in before}
            watch["skipped"] = result.skipped
            if ctx is not None:
                watch["loss_nonfinite"] = bool(ctx.loss_nonfinite)
                watch["grads_nonfinite"] = bool(ctx.grads_nonfinite)
                watch["first_nonfinite_rank"] = ctx.first_nonfinite_rank()
    return {
        "loss": [float(v) for v in losses],
        "found_inf": [float(v) for v in found],
        "scale": [float(v) for v in scales],
        "watch": watch,
    }


# -- scenarios: configuration checks ------------------------------------------------------------------
def scenario_mismatch(out: Path) -> None:
    precision = "bf16" if rank() == 0 else "fp16"
    result: dict[str, Any] = {}
    mp = ampkit.MixedPrecision(precision, device="cpu")
    try:
        ad.setup(mp)
        result["setup_error"] = None
    except ad.DistributedSetupError as exc:
        result["setup_error"] = str(exc)
    try:
        ad.shard(ResMLP(), precision)
        result["shard_error"] = None
    except ad.DistributedSetupError as exc:
        result["shard_error"] = str(exc)
    # The group still works after the errors: nothing is left half-way in a collective.
    probe = torch.ones(())
    dist.all_reduce(probe)
    result["group_alive"] = float(probe) == world()
    save(out, "mismatch", result)


# -- scenarios: one rank goes non-finite -------------------------------------------------------------
def _nan_in_rank1_batch(step: int, x: torch.Tensor) -> None:
    if step == NAN_STEP and rank() == 1:
        x[0, 0] = float("nan")


def scenario_ddp_nan(out: Path) -> None:
    seed_everything("ddp_nan", per_rank=False)
    model = DDP(ResMLP())
    opt = fused_adamw(model.parameters())
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    ctx = ad.setup(mp)
    run = train_regression(model, [opt], mp, range(STEPS), poison_batch=_nan_in_rank1_batch,
                           watch_step=NAN_STEP, ctx=ctx)
    run["params"] = full_params(model)
    save(out, "ddp_nan", run)


def _fsdp_resmlp(precision: str, *, dropout: float = 0.0, scaler: Any = None, grad_accumulation: int = 1):
    model = ResMLP(dropout=dropout)
    mp = ampkit.MixedPrecision(precision, device="cpu", scaler=scaler, grad_accumulation=grad_accumulation)
    ad.shard(model, mp)
    mp.prepare(model)
    ctx = ad.setup(mp)
    return model, mp, ctx


def _two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    # The head's shards are empty on rank 1 of 2: its SGD (non-fused: the engine reads
    # found_inf on the host) has nothing to update there, yet must skip with everyone.
    body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    return [fused_adamw(body), torch.optim.SGD(model.head.parameters(), lr=1e-2, momentum=0.9)]


def scenario_fsdp_nan(out: Path) -> None:
    seed_everything("fsdp_nan", per_rank=False)
    model, mp, ctx = _fsdp_resmlp("bf16")
    opts = _two_optimizers(model)
    run = train_regression(model, opts, mp, range(STEPS), poison_batch=_nan_in_rank1_batch,
                           watch_step=NAN_STEP, ctx=ctx)
    run["params"] = full_params(model)
    run["head_local_numel"] = [p.to_local().numel() for p in model.head.parameters()]
    # Reference: the same run with step 7 left out altogether.
    seed_everything("fsdp_nan", per_rank=False)
    ref, ref_mp, _ = _fsdp_resmlp("bf16")
    ref_opts = _two_optimizers(ref)
    train_regression(ref, ref_opts, ref_mp, range(NAN_STEP))
    train_regression(ref, ref_opts, ref_mp, range(NAN_STEP + 1, STEPS))
    run["reference_params"] = full_params(ref)
    save(out, "fsdp_nan", run)


def scenario_fsdp_shard_nan(out: Path) -> None:
    seed_everything("fsdp_shard_nan", per_rank=False)
    model, mp, ctx = _fsdp_resmlp("fp16")
    opts = _two_optimizers(model)
    fc = model.blocks[0].fc.weight

    def poison(step: int) -> None:
        # A non-finite value in a gradient row only rank 1 holds (what an fp16 overflow that
        # lands in one shard looks like): rank 0's own check is clean.
        if step == NAN_STEP and rank() == 1:
            fc.grad.to_local()[0, 0] = float("inf")

    run = train_regression(model, opts, mp, range(STEPS), poison_grads=poison, watch_step=NAN_STEP, ctx=ctx)
    run["params"] = full_params(model)
    save(out, "fsdp_shard_nan", run)


# -- scenarios: numerics against references -------------------------------------------------------------
def scenario_ddp_vs_single(out: Path) -> None:
    seed_everything("ddp_vs_single", per_rank=False)
    base = ResMLP()
    single = copy.deepcopy(base)
    model = DDP(base)
    opt = fused_adamw(model.parameters())
    mp = ampkit.MixedPrecision("fp32", device="cpu")
    ad.setup(mp)
    grads0: dict[str, torch.Tensor] = {}
    losses = []
    for step in range(STEPS):
        x, y = regression_batch(step, 16, (rank(), world()))
        loss = F.mse_loss(model(x), y)
        mp.backward(loss)
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.module.named_parameters()}
        mp.step(opt)
        losses.append(loss.detach())
    result: dict[str, Any] = {"loss": global_mean(losses), "params": full_params(model), "grads0": grads0}
    if rank() == 0:  # the single process with the whole batch of 16
        s_opt = fused_adamw(single.parameters())
        s_mp = ampkit.MixedPrecision("fp32", device="cpu")
        s_losses = []
        for step in range(STEPS):
            x, y = regression_batch(step, 16, None)
            loss = F.mse_loss(single(x), y)
            s_mp.backward(loss)
            if step == 0:
                result["single_grads0"] = {n: p.grad.detach().clone() for n, p in single.named_parameters()}
            s_mp.step(s_opt)
            s_losses.append(float(loss.detach()))
        result["single_loss"] = s_losses
        result["single_params"] = full_params(single)
    save(out, "ddp_vs_single", result)


def scenario_ddp_accumulation(out: Path) -> None:
    results: dict[str, Any] = {}
    for label, use_no_sync in (("no_sync", True), ("always_sync", False)):
        seed_everything("ddp_accumulation", per_rank=False)
        model = DDP(ResMLP())
        opt = fused_adamw(model.parameters())
        mp = ampkit.MixedPrecision("bf16", device="cpu", grad_accumulation=4)
        ad.setup(mp)
        micro = {"index": 0}
        reduced_at: list[int] = []

        # No annotations: DDP inspects them and wants a GradBucket, not a string.
        def counting_hook(state, bucket, micro=micro, log=reduced_at):  # type: ignore[no-untyped-def]
            log.append(micro["index"])
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(dist.group.WORLD, counting_hook)
        for i in range(12):
            micro["index"] = i
            x, y = regression_batch(100 + i, 8, (rank(), world()))
            window = mp.no_sync(model) if use_no_sync else contextlib.nullcontext()
            with window:
                with mp.autocast():
                    out_ = model(x)
                mp.backward(F.mse_loss(out_.float(), y))
            mp.step(opt)
        results[label] = {"reduced_at": reduced_at, "params": full_params(model),
                          "optimizer_steps": mp.optimizer_steps}
    save(out, "ddp_accumulation", results)


def scenario_fsdp_accumulation(out: Path) -> None:
    results: dict[str, Any] = {}
    for label in ("no_sync", "always_sync"):
        seed_everything("fsdp_accumulation", per_rank=False)
        model, mp, _ = _fsdp_resmlp("fp32", grad_accumulation=3)
        opt = fused_adamw(model.parameters())
        sharded_grad_after_micro = []
        for i in range(9):
            x, y = regression_batch(200 + i, 8, (rank(), world()))
            window = ad.no_sync(mp, model) if label == "no_sync" else contextlib.nullcontext()
            with window:
                mp.backward(F.mse_loss(model(x), y))
            # A reduce-scatter leaves a sharded .grad; without one the gradients wait unsharded.
            sharded_grad_after_micro.append(model.inp.weight.grad is not None)
            mp.step(opt)
        results[label] = {"sharded_grad": sharded_grad_after_micro, "params": full_params(model)}
    save(out, "fsdp_accumulation", results)


def scenario_fsdp_vs_ddp(out: Path) -> None:
    tokens = text_tokens()
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=32)
    seed_everything("fsdp_vs_ddp", per_rank=False)
    base = GPT(cfg)
    runs = {}
    for label in ("ddp", "fsdp"):
        net = copy.deepcopy(base)
        mp = ampkit.MixedPrecision("bf16", device="cpu")
        model: nn.Module = DDP(net) if label == "ddp" else ad.shard(net, mp)
        mp.prepare(model)
        ad.setup(mp)
        opt = fused_adamw(model.parameters(), lr=3e-3)
        losses = []
        for step in range(STEPS):
            x, y = gpt_batch(tokens, step, 8, cfg.block_size, (rank(), world()))
            with mp.autocast():
                logits = model(x)
            loss = GPT.loss(logits, y)
            mp.backward(loss)
            mp.step(opt)
            losses.append(loss.detach())
        runs[label] = global_mean(losses)
    save(out, "fsdp_vs_ddp", runs)


# -- scenarios: checkpoints and resume ---------------------------------------------------------------------
def _scaler() -> ampkit.DynamicLossScaler:
    # Grows every 3 clean steps from 2**14, so the scale overflows and backs off during the
    # run: resuming with a wrong scale or growth tracker changes which steps are skipped.
    return ampkit.DynamicLossScaler(init_scale=2.0**14, growth_interval=3)


def _ddp_resume_parts(seed_name: str):
    seed_everything(seed_name, per_rank=False)
    model = DDP(ResMLP(dropout=0.1))
    opt = fused_adamw(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=_scaler())
    ad.setup(mp)
    seed_everything(seed_name + "/dropout", per_rank=True)  # per-rank dropout streams
    return model, opt, sched, mp


def _fsdp_resume_parts(seed_name: str):
    seed_everything(seed_name, per_rank=False)
    model, mp, _ = _fsdp_resmlp("fp16", dropout=0.1, scaler=_scaler())
    opt = fused_adamw(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    seed_everything(seed_name + "/dropout", per_rank=True)
    return model, opt, sched, mp


def _resume_loop(model, opt, sched, mp, steps: range) -> dict[str, Any]:
    losses, found, scales = [], [], []
    for step in steps:
        x, y = regression_batch(step, 8, (rank(), world()))
        with mp.autocast():
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        mp.backward(loss)
        result = mp.step(opt)
        mp.scheduler_step(sched, result)
        losses.append(float(loss.detach()))
        found.append(float(result.found_inf))
        scales.append(float(result.scale))
    return {"loss": losses, "found_inf": found, "scale": scales}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


def scenario_resume_reference(out: Path) -> None:
    """Uninterrupted DDP and FSDP2 runs (saving at step 10, as the killed run does)."""
    ck = out / "reference-ckpt"
    model, opt, sched, mp = _ddp_resume_parts("ddp_resume")
    first = _resume_loop(model, opt, sched, mp, range(CKPT_STEP))
    ad.save_ddp_checkpoint(ck / "ddp.pt", model=model, optimizer=opt, engine=mp, scheduler=sched)
    rest = _resume_loop(model, opt, sched, mp, range(CKPT_STEP, STEPS))
    ddp = {**_merge(first, rest), "params": full_params(model)}
    # In-process resume from the same file, after scrambling every RNG and the weights.
    torch.manual_seed(999 + rank())
    model2, opt2, sched2, mp2 = _ddp_resume_parts("scrambled")
    ad.load_ddp_checkpoint(ck / "ddp.pt", model=model2, optimizer=opt2, engine=mp2, scheduler=sched2)
    again = _resume_loop(model2, opt2, sched2, mp2, range(CKPT_STEP, STEPS))
    ddp["in_process_resume"] = {**again, "params": full_params(model2)}
    # Control: the same resume without the per-rank RNG states draws other dropout masks.
    model3, opt3, sched3, mp3 = _ddp_resume_parts("scrambled")
    ad.load_ddp_checkpoint(ck / "ddp.pt", model=model3, optimizer=opt3, engine=mp3, scheduler=sched3,
                           restore_rng=False)
    _resume_loop(model3, opt3, sched3, mp3, range(CKPT_STEP, STEPS))
    ddp["resume_without_rng"] = {"params": full_params(model3)}

    model, opt, sched, mp = _fsdp_resume_parts("fsdp_resume")
    first = _resume_loop(model, opt, sched, mp, range(CKPT_STEP))
    ad.save_distributed_checkpoint(ck / "fsdp", model=model, optimizer=opt, engine=mp, scheduler=sched)
    rest = _resume_loop(model, opt, sched, mp, range(CKPT_STEP, STEPS))
    fsdp = {**_merge(first, rest), "params": full_params(model)}
    save(out, "resume_reference", {"ddp": ddp, "fsdp": fsdp})


def phase_kill(out: Path) -> None:
    ck = out / "ckpt"
    model, opt, sched, mp = _ddp_resume_parts("ddp_resume")
    _resume_loop(model, opt, sched, mp, range(CKPT_STEP))
    ad.save_ddp_checkpoint(ck / "ddp.pt", model=model, optimizer=opt, engine=mp, scheduler=sched)
    print(f"ddp: checkpoint at step {CKPT_STEP}", flush=True)

    model, opt, sched, mp = _fsdp_resume_parts("fsdp_resume")
    _resume_loop(model, opt, sched, mp, range(CKPT_STEP))
    ad.save_distributed_checkpoint(ck / "fsdp", model=model, optimizer=opt, engine=mp, scheduler=sched)
    print(f"fsdp: checkpoint at step {CKPT_STEP}", flush=True)
    _resume_loop(model, opt, sched, mp, range(CKPT_STEP, KILL_STEP))
    if rank() == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        def die(*args: Any, **kwargs: Any) -> Any:
            print(f"rank 1: SIGKILL while writing shards at step {KILL_STEP}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = die  # type: ignore[method-assign]
    ad.save_distributed_checkpoint(ck / "fsdp", model=model, optimizer=opt, engine=mp, scheduler=sched)
    print("not reached: the save above cannot complete without rank 1", flush=True)


def phase_resume(out: Path) -> None:
    ck = out / "ckpt"
    torch.manual_seed(4321 + rank())
    model, opt, sched, mp = _ddp_resume_parts("scrambled")
    ad.load_ddp_checkpoint(ck / "ddp.pt", model=model, optimizer=opt, engine=mp, scheduler=sched)
    ddp = {**_resume_loop(model, opt, sched, mp, range(CKPT_STEP, STEPS)), "params": full_params(model)}

    model, opt, sched, mp = _fsdp_resume_parts("scrambled")
    partial_left = (ck / ".fsdp.partial").exists()
    ad.load_distributed_checkpoint(ck / "fsdp", model=model, optimizer=opt, engine=mp, scheduler=sched)
    engine_after_load = mp.state_dict()
    fsdp = {**_resume_loop(model, opt, sched, mp, range(CKPT_STEP, STEPS)), "params": full_params(model)}
    fsdp["partial_left_by_kill"] = partial_left
    fsdp["engine_after_load"] = engine_after_load
    # Overwriting the checkpoint now succeeds and clears the leftovers of the killed save.
    ad.save_distributed_checkpoint(ck / "fsdp", model=model, optimizer=opt, engine=mp, scheduler=sched)
    fsdp["partial_left_after_save"] = (ck / ".fsdp.partial").exists()
    save(out, "resume", {"ddp": ddp, "fsdp": fsdp})


MAIN = [
    scenario_mismatch,
    scenario_ddp_nan,
    scenario_fsdp_nan,
    scenario_fsdp_shard_nan,
    scenario_ddp_vs_single,
    scenario_ddp_accumulation,
    scenario_fsdp_accumulation,
    scenario_fsdp_vs_ddp,
    scenario_resume_reference,
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["main", "kill", "resume"], required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (main phase)")
    args = parser.parse_args()
    dist.init_process_group(os.environ.get(ad.BACKEND_ENV, "gloo"))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.phase == "main":
            wanted = {s for s in args.only.split(",") if s}
            for scenario in MAIN:
                if not wanted or scenario.__name__.removeprefix("scenario_") in wanted:
                    scenario(args.out)
        elif args.phase == "kill":
            phase_kill(args.out)
        else:
            phase_resume(args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
