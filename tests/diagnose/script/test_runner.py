"""``ampkit doctor SCRIPT``: runs scripts like ``coverage run``, restores torch, never changes
the training it observes, and its CLI rules (exit codes, usage errors, SCRIPT vs TASK)."""

from __future__ import annotations

import json
import runpy
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ampkit.scaler
from ampkit.cli.doctor import is_script
from ampkit.cli.main import UsageError, main
from ampkit.diagnose.script.runner import merge_replayed_findings, run_script
from ampkit.findings import Finding


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def _torch_surface() -> dict[str, Any]:
    """Everything the observers patch or hook, by identity."""
    gs = torch.amp.grad_scaler.GradScaler
    ac = torch.amp.autocast_mode.autocast
    sched = torch.optim.lr_scheduler
    surface: dict[str, Any] = {
        f"GradScaler.{n}": vars(gs)[n] for n in ("__init__", "scale", "unscale_", "step", "update", "state_dict",
                                                  "load_state_dict")
    }
    surface.update({f"autocast.{n}": vars(ac)[n] for n in ("__init__", "__enter__", "__exit__")})
    surface.update({
        "torch.save": torch.save, "torch.load": torch.load, "torch.compile": torch.compile, "autograd.backward": torch.autograd.backward,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_, "clip_grad_value_": torch.nn.utils.clip_grad_value_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
        "Optimizer.__init__": vars(torch.optim.Optimizer)["__init__"],
        "LossScaler.scale": vars(ampkit.scaler.LossScaler)["scale"],
        "StaticLossScaler.scale": vars(ampkit.scaler.StaticLossScaler)["scale"],
    })
    for obj in vars(sched).values():
        if isinstance(obj, type) and issubclass(obj, sched.LRScheduler) and "step" in vars(obj):
            surface[f"{obj.__name__}.step"] = vars(obj)["step"]
    from torch.nn.modules import module as mod
    from torch.optim import optimizer as opt_mod

    surface["module hooks"] = (len(mod._global_forward_hooks), len(mod._global_forward_pre_hooks))
    surface["optimizer hooks"] = (len(opt_mod._global_optimizer_pre_hooks), len(opt_mod._global_optimizer_post_hooks))
    surface["warning filters"] = list(warnings.filters)
    return surface


TRAIN = """
    import sys
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)   # the first steps are skipped
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for step in range(5):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    torch.save({"model": model.state_dict(), "rng": torch.get_rng_state()}, sys.argv[1])
"""


def test_doctor_script_restores_every_patch_and_hook(tmp_path: Path) -> None:
    before = _torch_surface()
    script = _write(tmp_path / "train.py", TRAIN)
    run_script(script, [str(tmp_path / "out.pt")], measure_speed=False)
    assert _torch_surface() == before
    crash = _write(tmp_path / "crash.py", """
        import torch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
            raise KeyError("boom")
    """)
    report = run_script(crash, measure_speed=False)
    assert report.exit_status == 1
    assert _torch_surface() == before
    assert not torch.is_autocast_enabled("cpu")


@dataclass
class _Observed:
    path: Path
    report: Any


def _plain_then_observed(script: Path) -> tuple[Path, _Observed]:
    """Run ``script OUT`` as ``__main__`` without the doctor, then under it; the two OUT files (and the report)."""
    plain, observed = script.with_name("plain.pt"), script.with_name("observed.pt")
    argv = sys.argv[:]
    try:
        sys.argv = [str(script), str(plain)]
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return plain, _Observed(observed, run_script(script, [str(observed)], measure_speed=False))


def test_doctor_script_leaves_the_training_bit_identical(tmp_path: Path) -> None:
    """Observation and replays (which re-run forwards with the captured RNG state) must not change
    the weights, the RNG stream or anything else the script computes."""
    plain, observed = _plain_then_observed(_write(tmp_path / "train.py", TRAIN))
    report = observed.report
    assert report.replays, "the skipped first steps were expected to be replayed"
    a = torch.load(plain, weights_only=True)
    b = torch.load(observed.path, weights_only=True)
    assert torch.equal(a["rng"], b["rng"])
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_doctor_script_runs_as_main_with_argv_and_its_folder_on_the_path(tmp_path: Path) -> None:
    (tmp_path / "helper_mod_for_doctor.py").write_text("VALUE = 42\n")
    out = tmp_path / "seen.json"
    script = _write(tmp_path / "main.py", """
        import json, sys
        import helper_mod_for_doctor
        json.dump({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                   "helper": helper_mod_for_doctor.VALUE}, open(sys.argv[2], "w"))
    """)
    argv_before, path0_before = sys.argv[:], sys.path[0]
    try:
        report = run_script(script, ["--flag", str(out)], measure_speed=False)
    finally:
        sys.modules.pop("helper_mod_for_doctor", None)
    seen = json.loads(out.read_text())
    assert seen == {"name": "__main__", "argv": [str(script.resolve()), "--flag", str(out)],
                    "path0": str(tmp_path.resolve()), "helper": 42}
    assert report.exit_status == 0
    assert sys.argv == argv_before and sys.path[0] == path0_before


def test_doctor_script_module_mode_runs_like_python_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "doctorpkg_for_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    out = tmp_path / "ran.txt"
    (pkg / "train.py").write_text("import sys\nopen(sys.argv[1], 'w').write(__name__)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rc = main(["doctor", "-m", "doctorpkg_for_test.train", str(out)])
    finally:
        for name in [m for m in sys.modules if m.startswith("doctorpkg_for_test")]:
            del sys.modules[name]
    assert rc == 0
    assert out.read_text() == "__main__"


def test_doctor_script_exit_status_follows_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exits = _write(tmp_path / "exits.py", "import sys\nsys.exit(3)\n")
    assert main(["doctor", str(exits)]) == 3
    broken = _write(tmp_path / "broken.py", "def train():\n    return undefined_name\ntrain()\n")
    assert main(["doctor", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "NameError" in err and "broken.py" in err and "undefined_name" in err


def test_doctor_script_explains_a_known_error_with_the_users_line(tmp_path: Path) -> None:
    script = _write(tmp_path / "fill.py", """
        import torch
        scores = torch.zeros(2, 2, dtype=torch.float16)
        mask = torch.eye(2, dtype=torch.bool)
        scores = scores.masked_fill(mask, -1e9)
    """)
    report = run_script(script, measure_speed=False)
    [finding] = [f for f in report.findings if f.code == "CAST_OVERFLOW"]
    assert finding.severity == "error"
    assert finding.location is not None and finding.location.endswith("fill.py:5")
    assert "masked_fill" in finding.evidence["source"]
    assert report.exit_status == 1


def test_doctor_script_names_the_op_whose_backward_raised_a_dtype_mismatch(tmp_path: Path) -> None:
    # A regression target kept in bf16 by the dataset: huber_loss's forward accepts the fp32
    # prediction and the bf16 target, its backward raises "Found dtype BFloat16 but expected Float",
    # which names no op.  The finding names the op and its operands' dtypes; the fix casts the bf16 one.
    script = _write(tmp_path / "regress.py", """
        import torch
        from torch import nn
        from torch.nn import functional as F
        model = nn.Linear(4, 1)
        targets = torch.randn(8, 1).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(torch.randn(8, 4))
        loss = F.huber_loss(pred.float(), targets)
        loss.backward()
    """)
    report = run_script(script, measure_speed=False)
    [finding] = [f for f in report.findings if f.code == "DTYPE_MISMATCH"]
    assert finding.evidence["op"] == "huber_loss"
    assert finding.evidence["backward_node"] == "HuberLossBackward0"
    assert finding.evidence["saved_dtypes"] == {"input": "fp32", "target": "bf16"}
    assert "cast huber_loss's target to fp32" in finding.fix
    assert finding.location is not None and finding.location.endswith("regress.py:10")  # the backward's line


def test_doctor_script_precision_option_checks_an_fp32_script(tmp_path: Path) -> None:
    script = _write(tmp_path / "fp32.py", """
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-12)
        for _ in range(2):
            loss = model(torch.randn(8, 4) * 1e5).pow(2).mean()  # fine in fp32, beyond fp16's range
            loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    plain = run_script(script, measure_speed=False)
    assert plain.diagnoses == [] and not plain.has_errors
    checked = run_script(script, precision="fp16", measure_speed=False)
    assert [d.precision for d in checked.diagnoses] == ["fp16"]
    codes = {f.code: f for f in checked.findings}
    assert codes["AUTOCAST_INACTIVE"].severity == "info"
    assert "FORWARD_OVERFLOW" in codes or "CAST_OVERFLOW" in codes


def test_doctor_script_json_and_html_escape_what_the_user_controls(tmp_path: Path) -> None:
    script = _write(tmp_path / "tiny.py", "import torch\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\n")
    evil = '<script>alert("x")</script>'
    rc = main(["doctor", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), str(script), evil])
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "ampkit.doctor/1" and doc["environment"]["argv"] == [evil]
    html = (tmp_path / "r.html").read_text()
    assert evil not in html and "&lt;script&gt;" in html


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["doctor", "no_such_dir/train.py"], "no such script"),
        (["doctor", "--precision", "fp12", "x.py"], "--precision 'fp12' is not known"),
        (["doctor", "--json", "missing_dir/r.json", "x.py"], "does not exist"),
        (["doctor", "no_such_task_for_doctor", "--lr", "3"], "takes no arguments"),
        (["doctor"], "give a training script"),
    ],
)
def test_doctor_cli_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_doctor_cli_unknown_task_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "no_such_task_for_doctor"]) == 2
    err = capsys.readouterr().err
    assert "no_such_task_for_doctor" in err


def test_doctor_cli_target_rule_tells_scripts_from_tasks(tmp_path: Path) -> None:
    script = _write(tmp_path / "train_no_ext", "print(1)\n")
    assert is_script(str(script), as_module=False)
    assert is_script("any.module", as_module=True)
    assert not is_script("tinygpt", as_module=False)
    assert not is_script(f"{tmp_path / 'tasks.py'}:MyTask", as_module=False)
    with pytest.raises(UsageError, match="no such script"):
        is_script(str(tmp_path / "missing.py"), as_module=False)
    with pytest.raises(UsageError, match="is a directory"):
        is_script(str(tmp_path), as_module=False)


def test_doctor_script_names_roots_by_the_scripts_variables(tmp_path: Path) -> None:
    """Two models called separately (a GAN-style loop): each is a root, named by its variable."""
    script = _write(tmp_path / "gan.py", """
        import torch
        from torch import nn
        generator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.Adam(list(generator.parameters()) + list(critic.parameters()), lr=1e-3)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = critic(generator(torch.randn(8, 4))).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        critic.half()
        critic(torch.randn(2, 4))   # fp32 input into a now-fp16 model
    """)
    report = run_script(script, measure_speed=False)
    [finding] = [f for f in report.findings if f.code == "DTYPE_MISMATCH"]
    assert finding.module == "critic.0"
    assert report.steps == 2


def test_doctor_script_missing_file_raises() -> None:
    with pytest.raises(FileNotFoundError, match="no such script"):
        run_script("definitely/not/here.py")


def test_doctor_script_observes_a_compiled_model(tmp_path: Path) -> None:
    script = _write(tmp_path / "compiled.py", """
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(compiled(torch.randn(4, 8)), torch.randint(0, 2, (4,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run_script(script, measure_speed=False)
    assert report.exit_status == 0 and report.steps == 3 and not report.has_errors
    assert [r["why"] for r in report.replays] == ["checkup"] and "error" not in report.replays[0]
    assert not [w for w in caught if "global hooks" in str(w.message)]


def test_merge_replayed_findings_keeps_the_where_of_an_explained_exception() -> None:
    explained = Finding(code="CAST_OVERFLOW", severity="error", message="a fill did not fit; where: x", fix="f",
                        location="train.py:9", evidence={"where": "an eval forward of `model`",
                                                         "call_chain": ["train.py:30 evaluate()", "train.py:9"]})
    replayed = Finding(code="CAST_OVERFLOW", severity="error", message="aten::masked_fill in attn raised", fix="f",
                       module="attn", op="aten::masked_fill", evidence={"error": "value cannot be converted"})
    [merged] = merge_replayed_findings([explained], [replayed])
    assert merged.op == "aten::masked_fill" and merged.location == "train.py:9"
    assert merged.message == ("aten::masked_fill in attn raised; where: an eval forward of `model`; "
                              "call chain: train.py:30 evaluate() -> train.py:9")
    assert merged.evidence["call_chain"] == ["train.py:30 evaluate()", "train.py:9"]


def test_doctor_script_replays_a_forward_whose_masked_outputs_went_nan(tmp_path: Path) -> None:
    script = _write(tmp_path / "masked.py", """
        import torch
        from torch import nn
        class Attend(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(4, 4)
                self.out = nn.Linear(4, 4)
            def forward(self, x, pad):
                scores = self.q(x) @ x.transpose(-2, -1)
                return self.out(scores.masked_fill(pad[:, None, :], float("-inf")).softmax(-1) @ x)
        torch.manual_seed(0)
        model = Attend()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        pad = torch.tensor([[False, False, True], [True, True, True]])   # the second sequence is empty
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(2, 3, 4), pad)
            loss = out[0].float().mean()          # the empty sequence is left out of the loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """)
    report = run_script(script, measure_speed=False)
    codes = {f.code: f for f in report.findings}
    assert "BACKWARD_OVERFLOW" not in codes  # not "between the model and the loss": the forward made the NaN
    assert codes["FORWARD_NAN"].step == 1 and codes["FORWARD_NAN"].evidence["cause"] == "masked_row"


def test_doctor_script_scale_collapse_from_a_derivative_singularity_names_it(tmp_path: Path) -> None:
    script = _write(tmp_path / "dist.py", """
        import torch
        from torch import nn
        class Distances(nn.Module):
            def __init__(self):
                super().__init__()
                self.points = nn.Linear(3, 3)
            def forward(self, x):
                p = self.points(x)
                d = p[:, None] - p[None]
                return torch.sqrt((d * d).sum(-1) + 1e-8)   # 1e-8 is 0 in fp16: sqrt'(0) on the diagonal
        torch.manual_seed(0)
        model = Distances()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(16):
            with torch.autocast("cpu", dtype=torch.float16):
                dist = model(torch.randn(4, 3))
            loss = dist.float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """)
    report = run_script(script, measure_speed=False)
    codes = {f.code: f for f in report.findings}
    assert codes["BACKWARD_OVERFLOW"].evidence["singularity"]["function"] == "sqrt"
    collapse = codes["SCALE_COLLAPSE"]
    assert collapse.evidence["cause"] == "gradient_singularity"
    assert "derivative singularity" in collapse.message and "cannot help" in collapse.fix


def test_doctor_script_end_of_run_analysis_prints_progress_while_it_lasts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _write(tmp_path / "train.py", """
        import time
        import torch
        from torch import nn

        class Slow(nn.Module):  # every forward takes 50 ms, so the checkup's replays outlast the interval
            def forward(self, x):
                time.sleep(0.05)
                return x

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Slow(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    # An interval far below the analysis (the checkup replays the 50 ms forward): lines must come.
    run_script(script, heartbeat_s=0.01)
    lines = [line for line in capsys.readouterr().err.splitlines() if "analysing the run" in line]
    assert lines and lines[0].startswith("ampkit doctor: the script ended after 3 optimizer step(s); analysing the run")
    capsys.readouterr()
    run_script(script)  # the default interval (10 s) is longer than this analysis: no line at all
    assert "analysing the run" not in capsys.readouterr().err


EVAL_AFTER_TRAIN = """
    import sys
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0].mean(1))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 6, 16), torch.randint(0, 4, (4,))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    losses = []
    with torch.inference_mode():  # an evaluation loop: a forward, its loss, no backward, the next forward
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(nn.functional.cross_entropy(model(x), y))
    torch.save({"out": torch.stack(losses).clone()}, sys.argv[1])
"""


def test_doctor_script_leaves_an_eval_forward_after_the_loss_code_bit_identical(tmp_path: Path) -> None:
    """A model's forward that runs after loss-side code with no backward between (an evaluation loop) takes
    the same kernels under the doctor: nothing it installs for the loss side may be active in the forward
    (under an active torch-function mode, nn.MultiheadAttention's bf16 attention takes another path, whose
    numbers differ)."""
    plain, observed = _plain_then_observed(_write(tmp_path / "eval.py", EVAL_AFTER_TRAIN))
    a = torch.load(plain, weights_only=True)["out"]
    b = torch.load(observed.path, weights_only=True)["out"]
    assert torch.equal(a, b), f"largest difference {float((a - b).abs().max())}"
