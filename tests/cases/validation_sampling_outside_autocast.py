"""Text-conditioned denoiser: frozen text encoder cast to fp16, denoiser trained with fp16 autocast.

To save memory the frozen text encoder is stored in fp16 (its output is fp16); the trainable
denoiser keeps fp32 weights.  Training runs under autocast, which casts per op, so they mix.
The validation sampler runs under torch.no_grad() but outside autocast: the fp16 text embedding
meets the fp32 weight of the denoiser's cond_proj, "mat1 and mat2 must have the same dtype".
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOCAB, D_TEXT, D = 50, 16, 16


class Denoiser(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(D + 1, hidden)
        self.cond_proj = nn.Linear(D_TEXT, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, D))

    def forward(self, x: torch.Tensor, t: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        h = self.inp(torch.cat([x, t[:, None]], dim=-1)) + self.cond_proj(text_emb)
        return self.out(h)


@torch.no_grad()
def sample(denoiser: nn.Module, text_encoder: nn.Module, prompts: torch.Tensor,
           steps: int = 4) -> torch.Tensor:
    denoiser.eval()
    text_emb = text_encoder(prompts).mean(dim=1)
    x = torch.randn(len(prompts), D, device=prompts.device)
    for i in reversed(range(steps)):
        t = torch.full((len(x),), (i + 1) / steps, device=x.device)
        x = x - denoiser(x, t, text_emb) / steps
    denoiser.train()
    return x


text_encoder = nn.Sequential(nn.Embedding(VOCAB, D_TEXT), nn.Linear(D_TEXT, D_TEXT)).to(device)
text_encoder.requires_grad_(False)
text_encoder.to(dtype=torch.float16)                      # frozen: store it in fp16
denoiser = Denoiser().to(device)
optimizer = torch.optim.AdamW(denoiser.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)

captions = torch.randint(0, VOCAB, (160, 6))
images = torch.randn(160, D) * 0.5 + (captions[:, :1] % 4).float()
sample_mean = float("nan")
for step in range(10):
    x0, cap = images[step * 16:(step + 1) * 16].to(device), captions[step * 16:(step + 1) * 16].to(device)
    t = torch.rand(len(x0), device=device)
    noise = torch.randn_like(x0)
    xt = (1 - t[:, None]) * x0 + t[:, None] * noise
    with torch.autocast(device_type=device, dtype=torch.float16):
        text_emb = text_encoder(cap).mean(dim=1)
        loss = F.mse_loss(denoiser(xt, t, text_emb).float(), noise - x0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if (step + 1) % 5 == 0:
        sample_mean = sample(denoiser, text_encoder, captions[:4].to(device)).float().mean().item()
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g} sample mean {sample_mean:.3f}")
