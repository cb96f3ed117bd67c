"""Hand-rolled single-process data parallelism, like nn.DataParallel's threads: each shard's forward and
loss run in a worker thread while the main thread waits.  Fixed: each worker enters fp16 autocast
itself, inside the function it runs (autocast is thread-local), so every shard's forward runs in fp16.
"""
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
data, labels = torch.randn(128, 32), torch.randint(0, 10, (128,))


def shard_loss(shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = shard
    with torch.autocast("cpu", dtype=torch.float16):    # autocast is per thread: enter it here
        return F.cross_entropy(model(x).float(), y, reduction="sum")


with ThreadPoolExecutor(max_workers=2) as pool:   # one worker per "device"
    for step in range(8):
        x, y = data[step * 16:(step + 1) * 16], labels[step * 16:(step + 1) * 16]
        with torch.autocast("cpu", dtype=torch.float16):
            losses = list(pool.map(shard_loss, zip(x.chunk(2), y.chunk(2))))
            loss = torch.stack(losses).sum() / x.shape[0]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
