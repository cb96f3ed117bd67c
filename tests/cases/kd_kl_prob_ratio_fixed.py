"""The distillation of ``kd_kl_prob_ratio.py`` with the KL computed in log space from fp32 logits
(``F.log_softmax(logits.float())`` against the teacher's ``F.log_softmax(teacher(x).float())``,
``F.kl_div(..., log_target=True)``): log-probabilities of -30 are finite, no probability is divided."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)).requires_grad_(False)
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
with torch.no_grad():
    student[2].bias.copy_(torch.linspace(-15.0, 15.0, 10))  # confident hard-label head
optimizer = torch.optim.SGD(student.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
images, labels = torch.randn(48, 16), torch.randint(0, 10, (48,))
alpha = 0.5


def kl_teacher_student(logp_t, logp_s):
    return F.kl_div(logp_s, logp_t, reduction="batchmean", log_target=True)


for step in range(6):
    x, y = images[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            logp_teacher = F.log_softmax(teacher(x).float(), dim=-1)
        logits = student(x)
        kd = kl_teacher_student(logp_teacher, F.log_softmax(logits.float(), dim=-1))
        loss = alpha * F.cross_entropy(logits, y) + (1 - alpha) * kd
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
