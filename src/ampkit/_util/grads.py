"""Gradients for the fused AMP kernels: their global L2 norm, and their groups for the unscale.

``global_grad_norm``: the global L2 norm, computed as ``clip_grad_norm_`` computes it, without a sync.

One ``_foreach_norm`` (a fused kernel per dtype/device group) and one norm over the per-tensor
norms; the result is a float32 device scalar.  Used where a norm is wanted without clipping:
the engine's steps without ``clip_grad_norm`` and the telemetry of loops ampkit does not drive.

A sparse gradient (``nn.Embedding(sparse=True)``) counts through the values of its coalesced
form: duplicate indices are summed first, so the norm is that of the dense gradient it stands
for.  ``clip_grad_norm_`` itself has no sparse norm (``linalg_vector_norm`` has no sparse kernel);
coalescing copies the gradient's values, a cost paid only for sparse gradients.

>>> import torch
>>> float(global_grad_norm([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float16)]))
5.0
>>> dup = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([3.0, 1.0]), (2,), check_invariants=True)
>>> float(global_grad_norm([dup, torch.tensor([3.0])]))
5.0

``unscale_groups``: the tensors ``torch._amp_foreach_non_finite_check_and_unscale_`` multiplies in
place, grouped by (device, dtype) as the kernel wants them.  A complex gradient goes in as
``torch.view_as_real(g)`` (the kernel has no complex dtypes): a real view of the same memory, so
the real and imaginary parts are checked and multiplied in place, exactly as a real gradient of
twice the size would be.  ``_foreach_norm`` takes complex tensors as they are (the modulus).

>>> z = torch.tensor([3 + 4j])
>>> [(dtype, [t.shape for t in ts]) for (_, dtype), ts in unscale_groups([z]).items()]
[(torch.float32, [torch.Size([1, 2])])]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

__all__ = ["global_grad_norm", "grad_values", "unscale_groups"]


def grad_values(g: torch.Tensor) -> torch.Tensor:
    """The values a gradient stands for: a strided tensor as it is; a sparse COO gradient's coalesced values
    (duplicate indices summed, a copy); a compressed sparse one's (CSR, CSC, BSR, BSC: no duplicates) values.

    Implicit zeros are not among them: a count of zeros adds ``g.numel()`` minus the values' count.

    >>> grad_values(torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([2.0, 3.0]), (3,), check_invariants=True))
    tensor([5.])
    """
    if g.layout is torch.strided:
        return g
    if g.layout is torch.sparse_coo:
        return g.coalesce()._values()
    return g.values()


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||concat(grads)||_2`` as a float32 scalar on the gradients' device (``grads`` must not be empty)."""
    dense = [grad_values(g) for g in grads]
    norms = torch._foreach_norm(dense)
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))


def unscale_groups(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``grads`` as the fused unscale takes them: real views (sparse: values) grouped by (device, dtype).

    An uncoalesced fp16 sparse gradient is coalesced into a copy, as ``GradScaler`` checks it
    (duplicate indices can overflow fp16 only once summed); every other tensor is a view of the
    gradient's own memory, so the unscale writes through to it.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.is_sparse:
            g = (g.coalesce() if g.dtype is torch.float16 else g)._values()
        if g.is_complex():
            g = torch.view_as_real(g)
        groups[(g.device, g.dtype)].append(g)
    return groups
