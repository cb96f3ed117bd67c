"""The sha256 of a model's weights: what a verify run started from, and what preflight's verdicts hold for."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["state_sha256"]


def state_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of a ``state_dict``: names, dtypes, shapes and raw bytes, in sorted name order.

    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> state_sha256(a) == state_sha256(a), state_sha256(a) == state_sha256(b)
    (True, False)
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
