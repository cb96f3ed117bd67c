"""The verify section's tasks, loaded by ``ampkit verify``'s workers by file path (so: ampkit imports only).

``full``: tinygpt at GPU size, 12 layers x 768 (12 heads), 512-byte context, batch 16 (8192 tokens a
step), 60 steps with 10 of warm-up.  ``tiny``: the same task at a size the CPU tests run in seconds.
"""

from __future__ import annotations

from ampkit.tasks.tinygpt import TinyGPTTask

__all__ = ["full", "tiny"]


class _Sized(TinyGPTTask):
    default_steps = 60
    default_warmup = 10
    default_eval_every = 60


class _Tiny(TinyGPTTask):
    default_steps = 4
    default_warmup = 1
    default_eval_every = 4


def full() -> TinyGPTTask:
    return _Sized(d_model=768, n_layer=12, n_head=12, block_size=512, batch_size=16, eval_windows=32)


def tiny() -> TinyGPTTask:
    return _Tiny(d_model=16, n_layer=1, n_head=2, block_size=16, batch_size=2, eval_windows=2)
