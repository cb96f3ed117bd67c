"""The global L2 norm of a set of gradients, computed as ``clip_grad_norm_`` computes it, without a sync.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["global_grad_norm"]


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||concat(grads)||_2`` as a float32 scalar on the gradients' device (``grads`` must not be empty)."""
    dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
    norms = torch._foreach_norm(dense)
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))
