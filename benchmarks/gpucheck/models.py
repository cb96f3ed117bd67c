"""Models and batches shared by the sections, in a GPU size and a tiny (CPU test) size."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.tasks.gpt import GPT, GPTConfig

__all__ = ["GPT_SIZES", "MLP", "WIDE_MLP_SIZES", "gpt", "gpt_batches", "mlp", "mlp_batches", "wide_mlp",
           "wide_mlp_batches"]


class MLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear blocks and a classifier head.

    Only ops whose CUDA kernels are deterministic (no atomics in their backward), so two runs of the
    same steps can be compared bit for bit.
    """

    def __init__(self, d_in: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


MLP_SIZES = {"full": {"d_in": 512, "width": 1024, "depth": 4, "classes": 64, "batch": 256},
             "tiny": {"d_in": 8, "width": 16, "depth": 2, "classes": 4, "batch": 8}}


def mlp(tiny: bool, seed: int = 0) -> MLP:
    s = MLP_SIZES["tiny" if tiny else "full"]
    torch.manual_seed(seed)
    return MLP(s["d_in"], s["width"], s["depth"], s["classes"])


def mlp_batches(tiny: bool, n: int, device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, label) batches, made on the host from a seeded generator and moved to ``device``."""
    s = MLP_SIZES["tiny" if tiny else "full"]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s["batch"], s["d_in"], generator=g).to(device),
             torch.randint(0, s["classes"], (s["batch"],), generator=g).to(device)) for _ in range(n)]


GPT_SIZES = {"full": (GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=512), 16),
             "tiny": (GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8), 2)}
"""(config, batch) of the timing model: 12 x 768 with 8192 tokens a step keeps an H200 busy for
milliseconds, so a step's time is the GPU's work and not Python's launch overhead."""


def gpt(tiny: bool, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPT_SIZES["tiny" if tiny else "full"][0])


def gpt_batches(tiny: bool, n: int, device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg, batch = GPT_SIZES["tiny" if tiny else "full"]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (n, batch, cfg.block_size + 1), generator=g).to(device)
    return [(data[i, :, :-1], data[i, :, 1:]) for i in range(n)]


WIDE_MLP_SIZES = {"full": (4096, 16384, 8, 1024), "tiny": (32, 128, 2, 8)}
"""(width, hidden, batch, tokens) of the wide MLP block: 4096 x 16384 with 8192 tokens a step is
6.6 TFLOP of GEMMs per training step, milliseconds on an H100, where fp8's GEMMs beat bf16's."""


def wide_mlp(tiny: bool, seed: int = 0) -> nn.Sequential:
    """One transformer MLP block, Linear(width, hidden) -> GELU -> Linear(hidden, width)."""
    width, hidden, _, _ = WIDE_MLP_SIZES["tiny" if tiny else "full"]
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def wide_mlp_batches(tiny: bool, n: int, device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, label) batches of (batch, tokens, width) inputs and one label in [0, width) per token."""
    width, _, batch, tokens = WIDE_MLP_SIZES["tiny" if tiny else "full"]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, tokens, width, generator=g).to(device),
             torch.randint(0, width, (batch, tokens), generator=g).to(device)) for _ in range(n)]
