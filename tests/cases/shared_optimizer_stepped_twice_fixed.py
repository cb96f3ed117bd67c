"""Fixed twin of shared_optimizer_stepped_twice.py.

Each head gets its own Adam over its own parameters, so every optimizer in the dict is stepped once
per iteration through the GradScaler, followed by one scaler.update().
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
B, OBS, ACTIONS, H = 16, 12, 4, 64


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, ACTIONS))
        self.critic = nn.Sequential(nn.Linear(OBS, H), nn.Tanh(), nn.Linear(H, 1))

    def forward(self, obs: torch.Tensor):
        return self.actor(obs), self.critic(obs).squeeze(-1)


agent = Agent()
optimizers = {"actor": torch.optim.Adam(agent.actor.parameters(), lr=3e-4),
              "critic": torch.optim.Adam(agent.critic.parameters(), lr=3e-4)}
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    obs = torch.randn(B, OBS)
    actions = torch.randint(0, ACTIONS, (B,))
    returns = torch.randn(B)
    with torch.autocast("cpu", dtype=torch.float16):
        logits, values = agent(obs)
        advantage = returns - values.float().detach()
        logp = F.log_softmax(logits.float(), dim=-1).gather(1, actions[:, None]).squeeze(1)
        policy_loss = -(logp * advantage).mean()
        value_loss = F.mse_loss(values.float(), returns)
    scaler.scale(policy_loss + 0.5 * value_loss).backward()
    for name, opt in optimizers.items():
        scaler.step(opt)
    scaler.update()
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
print(f"policy {policy_loss.item():.4f} value {value_loss.item():.4f} scale {scaler.get_scale():.0f}")
