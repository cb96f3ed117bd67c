"""`import ampkit` and `ampkit lint` do not import torch: lint runs as a fast pre-commit hook."""

from __future__ import annotations

import subprocess
import sys


def test_imports_lint_cli_never_imports_torch(tmp_path) -> None:
    target = tmp_path / "train.py"
    target.write_text("from torch.cuda.amp import GradScaler\nscaler = GradScaler()\n")
    code = (
        "import sys\nfrom ampkit.cli.main import main\n"
        f"rc = main(['lint', {str(target)!r}])\n"
        "assert 'torch' not in sys.modules, 'ampkit lint imported torch'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "AMP101" in proc.stdout


def test_imports_public_names_resolve_lazily() -> None:
    import ampkit

    for name in ampkit.__all__:
        assert getattr(ampkit, name) is not None, name
    assert sorted(dir(ampkit)) == sorted(ampkit.__all__)


def test_imports_lint_fix_rewrites_without_torch_or_numpy(tmp_path) -> None:
    # --fix adds the rewrite and the atomic writer (ampkit._util.io) to the plain lint run; neither
    # may pull in torch or numpy.  Beyond what `import ampkit` itself loads (the lazy package face),
    # the lint package loads nothing of ampkit but lint and _util.io, with the one helper io uses,
    # _util.signals (the CLI's other subcommands are registered by cli.main, so that is checked first).
    target = tmp_path / "train.py"
    target.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    code = (
        "import sys\nimport ampkit\nface = set(sys.modules)\n"
        "import ampkit.lint.checker, ampkit.lint.fix, ampkit.lint.output\n"
        "outside = sorted(m for m in set(sys.modules) - face if m.startswith('ampkit.')"
        " and not m.startswith('ampkit.lint')"
        " and m not in ('ampkit._util', 'ampkit._util.io', 'ampkit._util.signals'))\n"
        "assert outside == [], f'ampkit.lint imported {outside}'\n"
        "from ampkit.cli.main import main\n"
        f"rc = main(['lint', '--fix', {str(target)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "assert heavy == [], f'ampkit lint --fix imported {heavy}'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fixed 1" in proc.stderr
    assert target.read_text() == 'import torch\nscaler = torch.amp.GradScaler("cuda")\n'


def test_imports_engine_without_keep_fp32_does_not_import_dynamo() -> None:
    # torch._dynamo takes about a second to import; only a keep-fp32 region (whose hooks must run
    # eagerly under torch.compile) needs it.
    code = (
        "import sys, torch\nimport ampkit\n"
        "mp = ampkit.MixedPrecision('bf16', device='cpu')\nmp.prepare(torch.nn.Linear(2, 2))\n"
        "assert 'torch._dynamo' not in sys.modules, 'an engine without keep_fp32 imported torch._dynamo'\n"
        "ampkit.MixedPrecision('bf16', device='cpu', keep_fp32=[torch.nn.LayerNorm]).prepare(torch.nn.LayerNorm(2))\n"
        "assert 'torch._dynamo' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_imports_non_fp8_engine_verify_and_doctor_never_import_torchao() -> None:
    # torchao takes about 2 s to import and logs on a CPU-only torch; only the fp8 path may load it.
    code = (
        "import importlib, pkgutil, sys, torch\nimport ampkit\n"
        "for p in ('bf16', 'fp16', 'fp32'):\n"
        "    ampkit.MixedPrecision(p, device='cpu').prepare(torch.nn.Sequential(torch.nn.Linear(32, 32)))\n"
        "import ampkit.cli.main, ampkit.diagnose, ampkit.verify\n"
        "for pkg in (ampkit.verify, ampkit.diagnose, ampkit.cli):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "assert 'torchao' not in sys.modules, 'a non-fp8 path imported torchao'\n"
        "ampkit.MixedPrecision('fp8', device='cpu')\n"
        "assert 'torchao' not in sys.modules, 'building an fp8 engine imports torchao before prepare'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
