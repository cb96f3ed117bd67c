"""``diagnose.capture``: the record of one forward (compared by identity) and the hooks that fill it."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.capture import Capture, CaptureHooks


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


def test_capture_hooks_keep_the_gradient_before_a_narrowing_cast() -> None:
    model = nn.Linear(4, 2)
    hooks = CaptureHooks()
    hooks.add_root(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(3, 4))
    loss = (out.float() * 3.0).sum()
    hooks.on_backward([loss], loss, None)
    loss.backward()
    (cap,) = hooks.new_window()
    assert cap.autocast == ("cpu", torch.bfloat16, True) and cap.loss is not None
    assert cap.grads_fp32[0] is not None and cap.grads_fp32[0].dtype == torch.float32
    assert torch.equal(cap.seed_grads()[0], torch.full((3, 2), 3.0))


def test_capture_hooks_capture_a_root_called_inside_another_once() -> None:
    inner = nn.Linear(4, 4)
    outer = nn.Sequential(inner, nn.ReLU())
    hooks = CaptureHooks()
    hooks.add_root(outer)
    hooks.add_root(inner)
    outer(torch.randn(2, 4)).sum().backward()
    inner(torch.randn(2, 4)).sum().backward()
    assert [c.root for c in hooks.new_window()] == [outer, inner]


def test_capture_hooks_budget_leaves_the_gradient_of_a_large_output_uncaptured() -> None:
    model = nn.Linear(4, 8)
    hooks = CaptureHooks(grad_capture_numel=10)
    hooks.add_root(model)
    model(torch.randn(1, 4)).sum().backward()  # 8 elements: within the budget
    model(torch.randn(2, 4)).sum().backward()  # 16: over it
    first, second = hooks.new_window()
    assert first.grads[0] is not None and second.grads == [None]


def test_capture_hooks_grad_only_leaves_forwards_without_autograd_uncaptured() -> None:
    model = nn.Linear(4, 2)
    hooks = CaptureHooks(grad_only=True)
    hooks.add_root(model)
    with torch.no_grad():
        model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    assert [c.grad_enabled for c in hooks.new_window()] == [True]
