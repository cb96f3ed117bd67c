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
