"""The distillation loop of ``teacher_thread_no_autocast.py`` with the teacher's function
decorated with ``torch.autocast``: the worker thread enters bf16 autocast itself."""
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).eval()
student = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 10))
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
data = torch.randn(64, 32)


@torch.autocast("cpu", dtype=torch.bfloat16)
def teacher_logits(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return teacher(x)


with ThreadPoolExecutor(max_workers=1) as pool:
    for step in range(4):
        x = data[step * 16:(step + 1) * 16]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            soft = pool.submit(teacher_logits, x)
            logits = student(x)
            loss = F.kl_div(F.log_softmax(logits.float(), -1), F.softmax(soft.result().float(), -1),
                            reduction="batchmean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
