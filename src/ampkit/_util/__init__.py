"""Private helpers shared by every layer of ampkit.

Each submodule holds one piece of low-level logic in one copy (see docs/architecture.md).
Nothing here imports another part of ampkit; ``io`` imports no torch, so ``ampkit lint`` can
use it and stay torch-free.
"""
