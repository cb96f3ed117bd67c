"""The DQN update of ``huber_td_target_fp16.py`` with the TD target cast to fp32 with the Q-values
(``td_target.float()``): both operands of the Huber loss are fp32, forward and backward."""
import copy

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
q_net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
target_net = copy.deepcopy(q_net).requires_grad_(False)
optimizer = torch.optim.SGD(q_net.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
states, next_states = torch.randn(64, 16), torch.randn(64, 16)
actions = torch.randint(0, 4, (64,))
rewards = torch.randn(64).half()  # the replay buffer stores rewards in fp16 to save memory
gamma = 0.99
for step in range(6):
    sl = slice(step * 8, (step + 1) * 8)
    with torch.autocast("cpu", dtype=torch.float16):
        q = q_net(states[sl]).gather(1, actions[sl, None]).squeeze(1)
        with torch.no_grad():
            td_target = rewards[sl] + gamma * target_net(next_states[sl]).max(dim=1).values
    loss = F.huber_loss(q.float(), td_target.float())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
