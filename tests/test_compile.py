from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import ampkit
from ampkit.tasks.gpt import GPT, GPTConfig


@pytest.mark.slow
def test_compile_inductor_model_trains_under_engine() -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, block_size=16))
    mp = ampkit.MixedPrecision("bf16", device="cpu", clip_grad_norm=1.0, keep_fp32=["lm_head"])
    mp.prepare(model)
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    data = torch.randint(0, 256, (4, 17))
    losses = []
    for _ in range(8):
        with mp.autocast():
            logits = compiled(data[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), data[:, 1:].reshape(-1))
        mp.backward(loss)
        assert mp.step(opt).applied
        losses.append(float(loss))
    assert logits.dtype == torch.float32, "lm_head kept in fp32 inside the compiled graph"
    assert losses[-1] < losses[0], f"the compiled model must learn: {losses}"
