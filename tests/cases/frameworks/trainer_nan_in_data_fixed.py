"""Fixed variant of trainer_nan_in_data.py: rows with missing values are dropped when the table is loaded."""
import torch
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments


def load_table(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    features = torch.randn(n, 12, generator=g)
    target = features[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    features[21, 7] = float("nan")  # "n/a" in the source file
    keep = torch.isfinite(features).all(dim=1)  # drop rows with missing values
    return features[keep], target[keep]


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(x).float(), labels)}


class Table(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = load_table()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


torch.manual_seed(0)
model = Regressor()
args = TrainingArguments(output_dir="/tmp/ampkit-doctor-trainer", bf16=True, use_cpu=True, max_steps=4,
                         per_device_train_batch_size=16, learning_rate=1e-3, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Table()).train()
