"""The loss-side backward: the op between the model and the loss whose backward first made a gradient
non-finite, found through its autograd node and judged (singularity, scale 1, the fp32 loss code)."""

from __future__ import annotations

from pathlib import Path

import torch

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.lossgrad import LossGrads, loss_grad_text
from ampkit.diagnose.script.losstrace import LossSideTrace

HERE = UserFrames([Path(__file__).parent])


def _traced(loss_code: object, scale: float) -> LossGrads:
    """Run ``loss_code(model_output)`` under the loss-side trace and backpropagate ``scale`` times its loss."""
    out = torch.randn(4, 3).requires_grad_(True)
    grads = LossGrads(scale)
    with LossSideTrace(HERE, lambda: False, grads=grads):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_code(out)  # type: ignore[operator]
        (loss.float() * scale).backward()
    return grads


def test_lossgrad_names_a_sqrt_singularity_made_by_fp16_rounding() -> None:
    def pairwise(emb: torch.Tensor) -> torch.Tensor:
        gram = emb @ emb.T  # fp16 under autocast; what follows stays fp16
        sq = gram.diagonal()[:, None] - gram  # 0 on the diagonal
        return sq.clamp(min=1e-12).sqrt().sum()  # 1e-12 is 0 in fp16: sqrt'(0) = inf

    bad = _traced(pairwise, 1024.0).judge()
    assert bad is not None and bad.node == "SqrtBackward0" and bad.singular == ("sqrt", "0")
    assert bad.persists and bad.fp32_finite is True  # in fp32 the clamp keeps 1e-12
    text = loss_grad_text(bad, "model", 3)
    assert text["severity"] == "error" and text["evidence"]["overflows_at_any_scale"] is True
    assert text["evidence"]["singularity"] == {"function": "sqrt", "at": "0", "confirmed": True}


def test_lossgrad_an_overflow_that_scale_1_avoids_is_ordinary_scaling() -> None:
    def big(emb: torch.Tensor) -> torch.Tensor:
        return (emb @ emb.T * 200).pow(2).sum()  # its gradient is ~1e5 x: inf in fp16 at scale 1024, not at 1

    bad = _traced(big, 1024.0).judge()
    assert bad is not None and bad.singular is None and bad.finite_at_scale_1 is True and not bad.persists
    assert loss_grad_text(bad, "model", 1)["severity"] == "info"


def test_lossgrad_finite_gradients_find_nothing_and_leave_no_hooks() -> None:
    grads = _traced(lambda emb: (emb @ emb.T).pow(2).mean(), 1024.0)
    assert grads.judge() is None and grads._handles == [] and grads.calls == []  # nothing kept alive
