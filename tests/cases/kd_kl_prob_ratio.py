"""Knowledge distillation, alpha * CE + (1 - alpha) * KL(teacher || student), with the KL written on
probabilities, ``sum(p_t * log(p_t / p_s))``, inside the fp16 autocast region. The student's confident
head (logits over +-15) gives its low classes probabilities of 1e-9 to 1e-13, 0 in fp16, while the
teacher gives them p_t > 0.01: p_t / 0 = inf. The first bad value is made outside any module, by that
division in the loss.
"""
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


def kl_teacher_student(p_t, p_s):
    return (p_t * torch.log(p_t / p_s)).sum(dim=-1).mean()


for step in range(6):
    x, y = images[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            p_teacher = teacher(x).softmax(dim=-1)
        logits = student(x)
        kd = kl_teacher_student(p_teacher, logits.softmax(dim=-1))
        loss = alpha * F.cross_entropy(logits, y) + (1 - alpha) * kd
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
