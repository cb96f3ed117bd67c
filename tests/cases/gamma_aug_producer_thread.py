"""Image classifier fed by a background producer thread (a DataLoader-style prefetcher with a queue)
that normalises each image and then applies a random gamma; fp16 autocast + GradScaler.  The gamma
runs on the normalised, partly negative pixels, and a fractional power of a negative number is NaN
(first bad value, made in the producer): NaN batches reach the loop, their losses are NaN, steps are skipped.
"""
import queue
import threading

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
images = torch.rand(64, 3, 8, 8)                      # pixels in [0, 1]
labels = torch.randint(0, 4, (64,))
MEAN, STD = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
gammas = torch.empty(64).uniform_(0.7, 1.5)
use_gamma = torch.rand(64) < 0.3


def augment(i: int) -> torch.Tensor:
    img = (images[i] - MEAN) / STD
    if use_gamma[i]:
        img = img.pow(gammas[i])                      # negative pixels ** 0.83 = NaN
    return img


def producer(out: queue.Queue, batches: int, batch_size: int = 8) -> None:
    for b in range(batches):
        idx = range(b * batch_size, (b + 1) * batch_size)
        out.put((torch.stack([augment(i) for i in idx]), labels[b * batch_size:(b + 1) * batch_size]))
    out.put(None)


model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
batches: queue.Queue = queue.Queue(maxsize=2)
threading.Thread(target=producer, args=(batches, 8), daemon=True).start()
while (item := batches.get()) is not None:
    x, y = item
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
