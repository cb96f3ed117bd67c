"""The compile watcher: ``torch.compile`` runs eagerly under the doctor, each call is reported with
its line, and a compiled model or step is diagnosed with the eager model's module names."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampkit.diagnose.report.json import doctor_document
from ampkit.diagnose.script.runner import ScriptReport, run_script
from ampkit.diagnose.script.watchers.compile import CompileWatch
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())

# A forward overflow inside a submodule (block.scale); COMPILE is replaced per variant.
OVERFLOW = """
    import torch
    from torch import nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x) * 30000.0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.block = Block()
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.block(torch.relu(self.embed(x))))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")

    def train_step(net, x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    net, step = model, train_step
    COMPILE
    for _ in range(2):
        step(net, torch.randn(8, 8) * 4, torch.randint(0, 2, (8,)))
"""

VARIANTS = {
    "compiled_model": "net = torch.compile(model)",
    "model_compile_method": "model.compile(mode='max-autotune')",
    "compiled_step": "step = torch.compile(train_step)",
}


def _script(tmp_path: Path, name: str, compile_line: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(OVERFLOW).replace("COMPILE", compile_line))
    return path


def test_compile_watch_compiled_model_or_step_names_the_eager_culprit(tmp_path: Path) -> None:
    def culprits(report: ScriptReport) -> list[tuple[str, str | None, str | None]]:
        return [(f.code, f.module, f.op) for f in report.findings if f.severity == "error"]

    eager = run_script(_script(tmp_path, "eager", "pass"), measure_speed=False)
    assert culprits(eager) == [("FORWARD_OVERFLOW", "block", "aten::mul")] and eager.compiled == []
    line = textwrap.dedent(OVERFLOW).splitlines().index("COMPILE") + 1
    for variant, compile_line in VARIANTS.items():
        compiled = run_script(_script(tmp_path, variant, compile_line), measure_speed=False)
        assert culprits(compiled) == culprits(eager), variant
        assert [c["location"] for c in compiled.compiled] == [f"{tmp_path / variant}.py:{line}"], variant
        assert doctor_document(compiled)["compiled"] == compiled.compiled


def test_compile_watch_records_each_form_and_runs_it_eagerly(tmp_path: Path) -> None:
    script = tmp_path / "forms.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Linear(4, 4)
        wrapped = torch.compile(model, backend="inductor", dynamic=False)
        assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and wrapped._orig_mod is model
        assert list(wrapped.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
        other = nn.Linear(4, 4)
        other.compile()

        @torch.compile
        def plain(x):
            assert not torch.compiler.is_compiling()
            return x * 2

        @torch.compile(mode="reduce-overhead")
        def tuned(x):
            assert not torch.compiler.is_compiling()
            return x + 1

        wrapped(torch.ones(2, 4)), other(torch.ones(2, 4)), plain(torch.ones(2)), tuned(torch.ones(2))
        assert torch.compile(model, disable=True) is model
    """))
    original = torch.compile
    report = run_script(script, measure_speed=False, replay=False)
    assert report.exit_status == 0
    assert [(c["kind"], c["target"], c["location"].rsplit(":", 1)[1], c["options"]) for c in report.compiled] == [
        ("module", "Linear", "5", {"backend": "inductor", "dynamic": False}),
        ("method", "Linear", "9", {}),
        ("function", "plain", "11", {}),
        ("function", "tuned", "16", {"mode": "reduce-overhead"}),
    ]
    assert torch.compile is original


@pytest.mark.filterwarnings("ignore:Using `torch.compile")  # the models service's discovery hooks are on
def test_compile_watch_alone_records_the_call_and_runs_the_module_eagerly() -> None:
    model = torch.nn.Linear(2, 2)
    with watching(CompileWatch) as w:
        line = sys._getframe().f_lineno + 1
        compiled = torch.compile(model, mode="reduce-overhead", disable=False)
        torch.compile(model, disable=True)  # compiles nothing: not a call to report
    assert compiled._orig_mod is model
    [call] = w.watcher.calls
    assert call.to_dict() == {"location": f"{HERE}:{line}", "kind": "module", "target": "Linear",
                              "options": {"mode": "reduce-overhead"}}
    x = torch.randn(3, 2)
    assert torch.equal(compiled(x), model(x))
