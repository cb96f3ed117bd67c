"""Fixed variant of gan_generator_wrong_scaler.py: the generator's loss is scaled by its own
scaler, the one that steps opt_g."""
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
NOISE = 4


def ring(n: int) -> torch.Tensor:
    angle = torch.rand(n) * 2 * math.pi
    return torch.stack([angle.cos(), angle.sin()], dim=1) + 0.05 * torch.randn(n, 2)


generator = nn.Sequential(nn.Linear(NOISE, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)).to(device)
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
scaler_g = torch.amp.GradScaler(device)
scaler_d = torch.amp.GradScaler(device)

for step in range(4):
    real = ring(16).to(device)
    z = torch.randn(16, NOISE, device=device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        fake = generator(z)
        d_real, d_fake = discriminator(real), discriminator(fake.detach())
        loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
    opt_d.zero_grad(set_to_none=True)
    scaler_d.scale(loss_d).backward()
    scaler_d.step(opt_d)
    scaler_d.update()

    with torch.autocast(device_type=device, dtype=torch.float16):
        d_gen = discriminator(fake)
        loss_g = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))
    opt_g.zero_grad(set_to_none=True)
    scaler_g.scale(loss_g).backward()
    scaler_g.step(opt_g)
    scaler_g.update()
print(f"loss_d {loss_d.item():.3f} loss_g {loss_g.item():.3f}")
