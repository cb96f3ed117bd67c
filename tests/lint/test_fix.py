"""``ampkit lint --fix`` rewrites the deprecated AMP API (AMP101) in real files, and the result runs."""

from __future__ import annotations

import importlib.util
import shutil
import stat
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ampkit.cli.main import main
from ampkit.lint import lint_source
from ampkit.lint.fix import fix_source

FIXTURES = Path(__file__).parent / "fixtures"


def _import_and_run(path: Path) -> tuple[Any, list[str]]:
    """Import ``path`` as a fresh module and call its ``run()``; return the result and the
    deprecation warnings raised on the way (decorators warn at import time)."""
    spec = importlib.util.spec_from_file_location(f"ampkit_fix_case_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        result = module.run()
    deprecations = [str(w.message) for w in caught
                    if issubclass(w.category, FutureWarning) and "deprecated" in str(w.message)]
    return result, deprecations


def test_fix_rewrites_a_real_file_to_the_golden_output(tmp_path: Path, capsys: Any) -> None:
    target = tmp_path / "train_step.py"
    shutil.copyfile(FIXTURES / "fix_AMP101_before.py", target)
    target.chmod(0o640)
    assert main(["lint", "--fix", str(target)]) == 0
    assert "fixed 5" in capsys.readouterr().err
    assert target.read_text() == (FIXTURES / "fix_AMP101_after.py").read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["train_step.py"]  # no temporary file left behind


def test_fix_output_runs_the_same_without_deprecation_warnings() -> None:
    (old_out, old_weight), old_warnings = _import_and_run(FIXTURES / "fix_AMP101_before.py")
    (new_out, new_weight), new_warnings = _import_and_run(FIXTURES / "fix_AMP101_after.py")
    assert len(old_warnings) >= 4, old_warnings  # custom_fwd, custom_bwd, GradScaler, autocast x2
    assert new_warnings == []
    assert new_out.dtype == old_out.dtype == torch.bfloat16
    assert torch.equal(new_out, old_out)
    assert torch.equal(new_weight, old_weight)


def test_fix_turns_positional_autocast_arguments_into_keywords() -> None:
    # torch.cuda.amp.autocast(enabled, dtype, cache_enabled) vs torch.amp.autocast(device_type, dtype, enabled):
    # inserting only the device would turn `enabled` into `dtype`.
    source = ("import torch\n"
              "def make():\n"
              "    return torch.cuda.amp.autocast(False, torch.bfloat16, False)\n")
    new, count = fix_source(source)
    assert count == 1
    assert 'torch.amp.autocast("cuda", enabled=False, dtype=torch.bfloat16, cache_enabled=False)' in new
    namespace: dict[str, Any] = {}
    exec(compile(new, "<fixed>", "exec"), namespace)  # the generated code, run for real
    ctx = namespace["make"]()
    assert (ctx.device, ctx.fast_dtype, ctx._enabled, ctx._cache_enabled) == ("cuda", torch.bfloat16, False, False)


def test_fix_leaves_noqa_lines_alone() -> None:
    source = ("import torch\n"
              "a = torch.cuda.amp.GradScaler()  # noqa: AMP101\n"
              "b = torch.cuda.amp.GradScaler(init_scale=8.0)\n")
    new, count = fix_source(source)
    assert count == 1
    assert new.splitlines()[1:] == ["a = torch.cuda.amp.GradScaler()  # noqa: AMP101",
                                    'b = torch.amp.GradScaler("cuda", init_scale=8.0)']


def test_fix_skips_an_imported_name_with_a_non_call_use() -> None:
    # Rewriting the import would change what `factory` refers to: leave the file as it is.
    source = ("from torch.cuda.amp import autocast\n"
              "factory = autocast\n"
              "with autocast():\n"
              "    pass\n")
    new, count = fix_source(source)
    assert (new, count) == (source, 0)
    assert [v.code for v in lint_source(new)] == ["AMP101"]


def test_fix_rewrites_module_alias_imports() -> None:
    source = ("from torch.cuda import amp\n"
              "scaler = amp.GradScaler(growth_interval=100)\n"
              "with amp.autocast(dtype=None):\n"
              "    pass\n")
    new, count = fix_source(source)
    assert count == 2
    assert new == ("from torch import amp\n"
                   'scaler = amp.GradScaler("cuda", growth_interval=100)\n'
                   'with amp.autocast("cuda", dtype=None):\n'
                   "    pass\n")


def test_fix_does_nothing_unless_amp101_is_selected(tmp_path: Path, capsys: Any) -> None:
    target = tmp_path / "t.py"
    target.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\nx = torch.load('p')\n")
    before = target.read_text()
    assert main(["lint", "--fix", "--select", "AMP113", str(target)]) == 1
    assert target.read_text() == before
    assert main(["lint", "--fix", str(target)]) == 1  # AMP113 is not fixable and remains
    assert "torch.amp.GradScaler(\"cuda\")" in target.read_text()
    out = capsys.readouterr().out
    assert out.splitlines()[-1].split()[1] == "AMP113"
