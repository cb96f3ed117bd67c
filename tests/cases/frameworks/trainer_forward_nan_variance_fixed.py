"""Fixed variant of trainer_forward_nan_variance.py: the variance is computed in fp32 around the mean."""
import torch
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments


class Standardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return ((x - mean) / torch.sqrt(var + 1e-5)).to(dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.standardize = Standardize()
        self.head = nn.Linear(32, 2)
        with torch.no_grad():
            self.proj.bias.fill_(300.0)  # sensor offset learnt by a previous run

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.standardize(self.proj(x)))
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class Readings(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = 10.0 * torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


torch.manual_seed(0)
model = Net()
args = TrainingArguments(output_dir="/tmp/ampkit-doctor-trainer", bf16=True, use_cpu=True, max_steps=4,
                         per_device_train_batch_size=16, learning_rate=1e-3, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Readings()).train()
