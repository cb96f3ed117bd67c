from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import ampkit
from ampkit import CheckpointError
from ampkit.precision import FP8_RECIPES
from tests.helpers.models import TinyNet, make_batches
from tests.helpers.mounts import run_after_mounting, tmpfs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "helpers" / "resume_worker.py"


def trained(tmp_path: Path, steps: int = 3):
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    for x, y in make_batches(steps):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step(opt)
    return model, opt, mp


def test_checkpoint_round_trip_restores_model_optimizer_engine_and_grads(tmp_path, seed) -> None:
    model, opt, mp = trained(tmp_path, steps=3)  # 3 micro-batches with accumulation 2: mid-window
    assert mp.micro_step == 1
    path = ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, engine=mp, extra={"epoch": 7})
    model2, opt2 = TinyNet(), None
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    mp2 = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    extra = ampkit.load_checkpoint(path, model=model2, optimizer=opt2, engine=mp2)
    assert extra == {"epoch": 7}
    assert mp2.state_dict() == mp.state_dict()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), "accumulated grads must survive a mid-window save"


def test_checkpoint_restores_rng_states(tmp_path) -> None:
    model = TinyNet()
    path = ampkit.save_checkpoint(tmp_path / "ck.pt", model=model)
    expected = (torch.rand(3), random.random())
    ampkit.load_checkpoint(path, model=model)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_checkpoint_truncated_file_gives_clear_error_and_is_left_intact(tmp_path) -> None:
    model = TinyNet()
    path = ampkit.save_checkpoint(tmp_path / "ck.pt", model=model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"corrupted or truncated.*resume from an earlier checkpoint"):
        ampkit.load_checkpoint(path, model=model)
    assert path.read_bytes() == data[: len(data) // 2]


def test_checkpoint_failed_save_keeps_previous_checkpoint(tmp_path) -> None:
    model = TinyNet()
    path = ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, extra={"v": 1})
    before = path.read_bytes()
    with pytest.raises(TypeError, match="weights_only"):
        ampkit.save_checkpoint(path, model=model, extra={"v": 2, "bad": object()})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"], "no temp file may be left behind"


def test_checkpoint_missing_engine_state_is_named(tmp_path) -> None:
    model = TinyNet()
    path = ampkit.save_checkpoint(tmp_path / "ck.pt", model=model)
    with pytest.raises(CheckpointError, match="CHECKPOINT_MISSING_SCALER"):
        ampkit.load_checkpoint(path, model=model, engine=ampkit.MixedPrecision("fp16", device="cpu"))


def test_checkpoint_not_an_ampkit_file_is_explained(tmp_path) -> None:
    other = tmp_path / "plain.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="not an ampkit checkpoint"):
        ampkit.load_checkpoint(other, model=TinyNet())
    with pytest.raises(CheckpointError, match="does not exist"):
        ampkit.load_checkpoint(tmp_path / "nope.pt", model=TinyNet())


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), *args], cwd=ROOT, check=True, capture_output=True,
                          text=True, timeout=240, **kwargs)


@pytest.mark.slow
def test_checkpoint_resume_after_sigkill_is_bit_identical(tmp_path) -> None:
    _check_resume_after_sigkill(tmp_path, "fp16")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:precision='fp8.*no fp8 GEMM:UserWarning")
@pytest.mark.parametrize("precision", list(FP8_RECIPES))
def test_checkpoint_fp8_resume_after_sigkill_is_bit_identical(tmp_path, precision: str) -> None:
    pytest.importorskip("torchao")
    _check_resume_after_sigkill(tmp_path, precision)
    assert torch.load(tmp_path / "resumed.pt", weights_only=True)["engine"]["precision"] == precision


def _check_resume_after_sigkill(tmp_path: Path, precision: str) -> None:
    total = 24
    ckpt = tmp_path / "run.pt"
    # The uninterrupted reference run first, in the process that then trains with checkpoints until
    # it is killed: it starts from a fresh build too, and no checkpoint exists while it trains.
    proc = subprocess.Popen([sys.executable, str(WORKER), "--reference", str(tmp_path / "reference.pt"),
                             "--reference-steps", str(total), "--steps", str(total // 2), "--out",
                             str(tmp_path / "partial.pt"), "--ckpt", str(ckpt), "--hang", "--precision", precision],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ckpt.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "worker died"
        assert time.monotonic() < deadline, "the worker never wrote a checkpoint"
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.5))  # a random point after the first save, saves still in flight
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    _run("--steps", str(total), "--out", str(tmp_path / "resumed.pt"), "--ckpt", str(ckpt), "--resume",
         "--precision", precision)
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    res = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, res["model"][name]), f"parameter {name} differs after resume"
    for key, state in ref["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, res["optimizer"]["state"][key][field]), f"optimizer state {key}.{field}"
    assert ref["engine"] == res["engine"] and ref["lr"] == res["lr"]


def test_checkpoint_atomic_write_uses_umask_mode(tmp_path) -> None:
    from ampkit._util.io import atomic_write_bytes

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "report.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o644


# Saves a 1 MiB model to sys.argv[1]; prints the error, then what the directory holds.
SAVE_AND_REPORT = """
import os, sys, torch, ampkit
try:
    ampkit.save_checkpoint(sys.argv[1], model=torch.nn.Linear(512, 512))
    print("saved")
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc)
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))))
"""


def test_checkpoint_save_on_a_full_disk_names_the_path_and_no_space(tmp_path) -> None:
    target = tmp_path / "ck.pt"
    result = run_after_mounting(tmpfs(tmp_path, "256k"), [sys.executable, "-c", SAVE_AND_REPORT, str(target)],
                                cwd=ROOT)
    first, listing = result.stdout.splitlines()
    assert first.startswith(f"OSError 28 cannot write {str(target)!r}: no space left on the device"), result
    assert "inline_container" not in result.stdout + result.stderr
    assert listing == "[]", "the partial temp file must be removed"


def test_checkpoint_save_to_a_directory_names_it(tmp_path) -> None:
    (tmp_path / "ck.pt").mkdir()
    with pytest.raises(IsADirectoryError, match=rf"cannot write {str(tmp_path / 'ck.pt')!r}: it is a directory"):
        ampkit.save_checkpoint(tmp_path / "ck.pt", model=TinyNet())
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_checkpoint_load_of_a_text_file_is_not_an_ampkit_checkpoint(tmp_path) -> None:
    text = tmp_path / "notes.pt"
    text.write_text("epoch 3, loss 0.25\n")
    with pytest.raises(CheckpointError, match=r"notes.pt' is not an ampkit checkpoint \(it starts with b'epoch"):
        ampkit.load_checkpoint(text, model=TinyNet())
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"not an ampkit checkpoint \(it is empty\)"):
        ampkit.load_checkpoint(tmp_path / "empty.pt", model=TinyNet())


def test_checkpoint_load_of_a_directory_names_it(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"is a directory, not a file.*load_distributed_checkpoint"):
        ampkit.load_checkpoint(tmp_path, model=TinyNet())


def test_checkpoint_load_of_pickled_code_refuses_and_never_suggests_unsafe_loading(tmp_path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"format": "ampkit.checkpoint/1", "model": Exploit()}, evil)
    with pytest.raises(CheckpointError) as err:
        ampkit.load_checkpoint(evil, model=TinyNet())
    message = str(err.value)
    assert "contains objects that are not allowed; refusing to execute them" in message
    assert "GLOBAL posix.system" in message or "GLOBAL os.system" in message, message
    assert "weights_only=False" not in message and "will likely succeed" not in message
    # No chained torch error either: a traceback would print its weights_only=False advice.
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert not marker.exists()
# -- a checkpoint that does not fit changes nothing ------------------------------------------------
def _params(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def _unchanged(before: list[torch.Tensor], *modules: torch.nn.Module) -> bool:
    after = [p for m in modules for p in m.parameters()]
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _saved(tmp_path: Path, **kw) -> Path:
    model, opt, mp = trained(tmp_path, steps=4)
    return ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, engine=mp, **kw)


def test_checkpoint_mismatched_optimizer_groups_raise_and_leave_the_model_untouched(tmp_path) -> None:
    path = _saved(tmp_path)
    model = TinyNet()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"optimizer\[0\] \(AdamW\).*1 parameter group.*2 of sizes"):
        ampkit.load_checkpoint(path, model=model, optimizer=opt)
    assert _unchanged(before, model)


def test_checkpoint_optimizer_state_of_other_shapes_raises_and_leaves_everything_untouched(tmp_path) -> None:
    # Same number of parameters, other order: torch would load exp_avg of one shape onto another.
    path = _saved(tmp_path)
    model = TinyNet()
    opt = torch.optim.AdamW(list(reversed(list(model.parameters()))), lr=1e-2)
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"optimizer state does not fit the parameters \(parameter 0 exp_avg"):
        ampkit.load_checkpoint(path, model=model, optimizer=opt, engine=mp)
    assert _unchanged(before, model) and not opt.state and mp.optimizer_steps == 0


def test_checkpoint_model_shape_mismatch_raises_before_copying_the_layers_that_fit(tmp_path) -> None:
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=small)
    big = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    before = _params(big)
    with pytest.raises(CheckpointError, match=r"shape mismatch \['1\.weight: saved \(2, 8\), here \(3, 8\)'"):
        ampkit.load_checkpoint(tmp_path / "ck.pt", model=big)
    assert _unchanged(before, big)  # torch alone would have copied layer 0 before raising


def test_checkpoint_engine_precision_mismatch_raises_and_leaves_model_and_optimizer_untouched(tmp_path) -> None:
    path = _saved(tmp_path)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"engine state does not fit: .*saved with precision='fp16'"):
        ampkit.load_checkpoint(path, model=model, optimizer=opt, engine=ampkit.MixedPrecision("bf16", device="cpu"))
    assert _unchanged(before, model) and not opt.state


def test_checkpoint_mid_window_accumulation_mismatch_raises_and_leaves_model_untouched(tmp_path) -> None:
    model, opt, mp = trained(tmp_path, steps=3)  # mid-window: 1 of 2 micro-batches
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, engine=mp)
    target = TinyNet()
    before = _params(target)
    with pytest.raises(CheckpointError, match=r"saved mid-window \(1 of 2 micro-batches\).*accumulates 4"):
        ampkit.load_checkpoint(tmp_path / "ck.pt", model=target,
                               engine=ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=4))
    assert _unchanged(before, target) and all(p.grad is None for p in target.parameters())


def test_checkpoint_scheduler_of_another_kind_raises_and_leaves_everything_untouched(tmp_path) -> None:
    model, opt, mp = trained(tmp_path, steps=4)
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, engine=mp,
                           scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3))
    target = TinyNet()
    opt2 = torch.optim.AdamW(target.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    before, sched_before = _params(target), sched.state_dict()
    with pytest.raises(CheckpointError, match=r"scheduler\[0\] \(CosineAnnealingLR\): the saved state lacks \['T_max'"):
        ampkit.load_checkpoint(tmp_path / "ck.pt", model=target, optimizer=opt2, scheduler=sched)
    assert _unchanged(before, target) and not opt2.state and sched.state_dict() == sched_before


def _drop(key: str):
    return lambda payload: payload.pop(key)


def _bad_rng(payload: dict) -> None:
    payload["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)  # torch's CPU generator state is 5056 bytes


def _string_step(payload: dict) -> None:
    payload["optimizer"][0]["state"][0]["step"] = "ten"


@pytest.mark.parametrize(("tamper", "message"), [
    (_drop("rng"), "without its 'rng' entries"),
    (_drop("extra"), "without its 'extra' entries"),
    (_bad_rng, "the saved RNG state cannot be restored"),
    (_string_step, r"parameter 0 step: a str, not a number"),
], ids=["no-rng", "no-extra", "bad-rng-tensor", "string-step"])
def test_checkpoint_malformed_parts_raise_before_anything_is_loaded(tmp_path, tamper, message: str) -> None:
    payload = torch.load(_saved(tmp_path), weights_only=True)
    tamper(payload)
    path = tmp_path / "tampered.pt"
    torch.save(payload, path)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    before, rng = _params(model), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message):
        ampkit.load_checkpoint(path, model=model, optimizer=opt, engine=mp)
    assert _unchanged(before, model) and not opt.state and mp.optimizer_steps == 0 and mp.micro_step == 0
    assert torch.equal(torch.get_rng_state(), rng)  # the trial restore of the saved RNG put the current one back
