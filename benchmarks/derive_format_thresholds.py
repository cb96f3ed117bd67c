"""What each preflight format gives on well-scaled models: the numbers ``thresholds.FORMAT_SQNR`` and
``FORMAT_FLUSH`` are derived from.

Well-scaled models: a LayerNorm'd MLP stack (pre-norm residual blocks, GELU) on Gaussian inputs, and a small
byte-level GPT (``ampkit.tasks.gpt``) on random tokens, both at their default initialisation, three seeds each.
For every format, preflight's own replay measures the lowest of the module forward-output SQNRs and the gradients'
SQNR (all parameters together) and the largest share of an operand's non-zero values flushed to zero; the
thresholds sit below the lowest SQNR and above the largest flush by a margin (docs/preflight.md).

Run: ``.venv/bin/python benchmarks/derive_format_thresholds.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.formats import ALL_FORMATS
from ampkit.tasks.gpt import GPT, GPTConfig


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


def _mlp(seed: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), *[_Block(64) for _ in range(4)], nn.LayerNorm(64), nn.Linear(64, 16))
    batches = [(torch.randn(64, 64), torch.randint(0, 16, (64,))) for _ in range(2)]
    return model, batches, lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1])


def _gpt(seed: int) -> tuple[nn.Module, list[torch.Tensor], object]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=32, dropout=0.0))
    batches = [torch.randint(0, 256, (8, 33)) for _ in range(2)]

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        logits = m(b[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    return model, batches, loss


def main() -> None:
    lowest: dict[str, list[float]] = {f: [] for f in ALL_FORMATS}
    flush: dict[str, list[float]] = {f: [] for f in ALL_FORMATS}
    for build in (_mlp, _gpt):
        for seed in range(3):
            model, batches, loss = build(seed)
            result = preflight_model(model, batches, loss_fn=loss, formats="all")  # type: ignore[arg-type]
            for report in result.formats:
                forward = [layer.forward_sqnr_db for layer in report.layers]
                values = [v for v in forward if v is not None and not math.isnan(v)]
                if report.grad_sqnr_db is not None:
                    values.append(report.grad_sqnr_db)
                lowest[report.format].append(min(values))
                shares = [ops.get("underflows%", 0.0) / 100 for layer in report.layers
                          for ops in layer.operands.values()]
                flush[report.format].append(max(shares, default=0.0))
                print(f"{build.__name__[1:]} seed {seed} {report.format:18} verdict {report.verdict:7} lowest SQNR "
                      f"{min(values):6.1f} dB  worst flush {max(shares, default=0.0):.4f}", flush=True)
    print("\nformat              lowest SQNR (dB)   largest flush share")
    for fmt in ALL_FORMATS:
        print(f"{fmt:18}  {min(lowest[fmt]):10.1f}               {max(flush[fmt]):.4f}")


if __name__ == "__main__":
    main()
