"""The feature distillation of ``cosine_distill_zero_teacher.py`` with the teacher's embedding normalised
in fp32 (``target.float()``): F.normalize's 1e-12 floor holds in fp32, so a zero embedding normalises to
0 and its distance to the student's embedding is finite instead of NaN."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False))
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
teacher.requires_grad_(False)
optimizer = torch.optim.SGD(student.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
inputs = torch.randn(48, 16)
inputs[::8] = 0.0  # one sample per batch lost its modality: zero-filled


def cosine_distill(student_emb, teacher_emb):
    s, t = F.normalize(student_emb, dim=-1), F.normalize(teacher_emb, dim=-1)
    return F.mse_loss(s, t)  # (2 - 2 cos) / dim


for step in range(6):
    x = inputs[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            target = teacher(x)
        loss = cosine_distill(student(x), target.float())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
