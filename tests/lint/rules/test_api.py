"""``ampkit.lint.rules.api``: AMP101 (deprecated API), AMP109, AMP110, AMP113."""

from __future__ import annotations

from . import hits


def test_api_deprecated_api_behind_a_version_check_is_deliberate() -> None:
    assert hits(
        "import torch\n"
        "TORCH_GE_2_4 = True\n"
        "a = torch.amp.GradScaler('cuda') if TORCH_GE_2_4 else torch.cuda.amp.GradScaler()\n"
        "try:\n"
        "    from torch.amp import GradScaler\n"
        "    b = GradScaler('cuda')\n"
        "except ImportError:\n"
        "    b = torch.cuda.amp.GradScaler()\n"
        "c = torch.cuda.amp.GradScaler()\n"
    ) == [(9, "AMP101")]
