"""``script.capture.Capture``: a record of one forward, compared by identity."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.script.capture import Capture


def _capture(model: nn.Module, x: torch.Tensor) -> Capture:
    return Capture(root=model, args=(x,), kwargs={}, step=1, device=torch.device("cpu"), param_dtype=torch.float32,
                   autocast_enabled=True, autocast_dtype=torch.bfloat16, other_autocast=(),
                   rng_cpu=torch.get_rng_state(), outputs=[model(x).detach()])


def test_capture_is_found_in_a_list_by_identity_without_reading_its_tensors() -> None:
    """Two forwards of one model on batches of the same shape: a window (a list of captures) removes the
    second without comparing field by field, which would ask a tensor of several values for its truth
    (a thread handing its forward to another thread's backward does exactly that)."""
    model = nn.Linear(4, 2)
    first, second = _capture(model, torch.randn(3, 4)), _capture(model, torch.randn(3, 4))
    window = [first, second]
    window.remove(second)
    assert window == [first] and window[0] is first
    assert first != _capture(model, torch.randn(3, 4))
