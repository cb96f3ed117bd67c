"""Distilling a bf16-pre-trained teacher into a small student, fixed: the teacher runs in bf16.

The frozen teacher gets its own bf16 autocast region (the precision it was trained in, with
fp32's range) nested in the student's fp16 one, so its ~1e6 activations stay finite; the student
keeps fp16 autocast and its GradScaler.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
T = 2.0


class Teacher(nn.Module):
    def __init__(self, d_in: int = 32, d: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(self.norm(h))


def load_bf16_pretrained(teacher: Teacher) -> None:
    """Stand-in for the bf16 checkpoint: its MLP carries large weights (bf16 never overflowed)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        teacher.fc1.weight.normal_(0.0, 2.0, generator=gen)
        teacher.fc2.weight.normal_(0.0, 1500.0, generator=gen)


teacher = Teacher().to(device).eval().requires_grad_(False)
load_bf16_pretrained(teacher)
student = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10)).to(device)
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)

inputs, labels = torch.randn(160, 32), torch.randint(0, 10, (160,))
skipped = 0
for step in range(10):
    x, y = inputs[step * 16:(step + 1) * 16].to(device), labels[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16):
            t_logits = teacher(x)
        s_logits = student(x)
        kd = F.kl_div(F.log_softmax(s_logits.float() / T, dim=-1), F.softmax(t_logits.float() / T, dim=-1),
                      reduction="batchmean") * T * T
        loss = kd + F.cross_entropy(s_logits.float(), y)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    skipped += scaler.get_scale() < scale
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} skipped {skipped} of 10 scale {scaler.get_scale():g}")
