"""A local Hugging Face model directory as preflight's target: the model in fp32 and sample batches.

The weights are the user's own (``from_pretrained`` of the directory, offline, upcast to fp32 for the fp32
pass: a bf16 checkpoint is judged as it will train under autocast, from fp32 master weights).  Batches:

* ``text``: the file is tokenised with the directory's tokenizer and cut into ``num_batches`` batches of
  ``batch_size`` rows of ``seq_len`` tokens, with ``labels = input_ids`` (a causal LM's loss);
* ``batches``: a safetensors file of the model's keyword inputs (``labels`` included, so the model returns
  its loss), split along the first dimension into ``num_batches`` batches.  safetensors holds tensors only:
  nothing in it is executed or unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit.diagnose.preflight.fp32pass import LossFn, default_loss

__all__ = ["load_model_dir"]


def load_model_dir(directory: Path, *, text: str | None, batches: str | None, num_batches: int, batch_size: int,
                   seq_len: int) -> tuple[nn.Module, list[dict[str, torch.Tensor]], LossFn]:
    """The model of ``directory`` (fp32, train mode), its sample batches and its loss (see the module docstring)."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError("a Hugging Face model directory needs transformers: pip install ampkit[hf]") from exc
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    architectures = list(getattr(config, "architectures", None) or [])
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    if text is not None:
        if not causal:
            raise ValueError(f"--text gives a causal-LM loss, but the directory's architecture is "
                             f"{architectures or 'not named in config.json'}; pass --batches FILE with the model's "
                             "inputs and labels instead")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                                  dtype=torch.float32)
        samples = _text_batches(directory, transformers, Path(text), num_batches, batch_size, seq_len)
    else:
        assert batches is not None
        model = _model_for(transformers, directory, architectures, causal)
        samples = _file_batches(Path(batches), num_batches)
    model.train()
    return model, samples, default_loss


def _model_for(transformers: Any, directory: Path, architectures: list[str], causal: bool) -> nn.Module:
    if causal:
        cls = transformers.AutoModelForCausalLM
    else:
        named = getattr(transformers, architectures[0], None) if architectures else None
        cls = named or transformers.AutoModel
    return cls.from_pretrained(directory, local_files_only=True, dtype=torch.float32)  # type: ignore[no-any-return]


def _text_batches(directory: Path, transformers: Any, path: Path, num_batches: int, batch_size: int,
                  seq_len: int) -> list[dict[str, torch.Tensor]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    rows = ids.numel() // seq_len
    if rows < batch_size:
        raise ValueError(f"--text {str(path)!r} has {ids.numel()} tokens; one batch needs {batch_size} × {seq_len} = "
                         f"{batch_size * seq_len}. Give a longer text, or a smaller --batch-size / --seq-len")
    count = min(num_batches, rows // batch_size)
    block = ids[: count * batch_size * seq_len].reshape(count, batch_size, seq_len)
    return [{"input_ids": b.clone(), "labels": b.clone()} for b in block]


def _file_batches(path: Path, num_batches: int) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if not tensors:
        raise ValueError(f"--batches {str(path)!r} holds no tensor; save the model's keyword inputs "
                         "(input_ids, attention_mask, labels, ...) with safetensors.torch.save_file")
    rows = {t.shape[0] if t.dim() else 0 for t in tensors.values()}
    if len(rows) != 1 or 0 in rows:
        raise ValueError(f"--batches {str(path)!r}: every tensor must share its first dimension (the batch rows); "
                         f"got {dict((k, list(v.shape)) for k, v in tensors.items())}")
    count = min(num_batches, rows.pop())
    pieces = {k: torch.chunk(v, count) for k, v in tensors.items()}
    return [{k: chunks[i] for k, chunks in pieces.items()} for i in range(count)]
