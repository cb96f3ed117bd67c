"""Image-text contrastive training (a CLIP-style two-tower model), compiled with torch.compile.

The head compares the two embeddings with a raw dot product: they are never L2-normalised, so
the similarity matmul in fp16 exceeds 65504 and the logits hold inf.
"""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class ImageTower(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.proj = nn.Linear(32, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(images))))
        return self.proj(h.mean(dim=(2, 3)))


class TextTower(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens))


class ContrastiveHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.659))  # log(1 / 0.07), as in CLIP

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * img @ txt.t()


class TwoTower(nn.Module):
    def __init__(self, vocab: int = 300, dim: int = 64) -> None:
        super().__init__()
        self.image = ImageTower(dim)
        self.text = TextTower(vocab, dim)
        self.head = ContrastiveHead()

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.image(images), self.text(tokens))


model = TwoTower()
with torch.no_grad():  # towers restored from separately pre-trained encoders: embedding norms in the hundreds
    model.image.proj.weight.mul_(2000.0)
    model.text.embed.weight.mul_(40.0)
compiled = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")

for step in range(3):
    images = torch.rand(8, 3, 16, 16)
    tokens = torch.randint(0, 300, (8, 6))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = compiled(images, tokens).float()
        labels = torch.arange(8)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
