"""Source: fastino-ai/GLiNER2 pull request #155 (``log1p(-p.clamp(max=1.0 - 1e-6))``: in bf16 the
bound rounds to exactly 1.0 and the clamp does nothing).

A span tagger trained under bf16 autocast adds a consistency term: the probability that some span
covers a token, ``1 - prod(1 - p_span)``, computed in log space as a ``scatter_add`` of
``log1p(-p.clamp(max=1 - 1e-6))`` over the spans of each token. The freshly initialised span scorer
gives some spans logits above 7, whose bf16 sigmoid is exactly 1.0; the clamp's bound is 1.0 in bf16
too, so log1p(-1) = -inf. The forward stays finite (the token's coverage is 1 - exp(-inf) = 1), but
the backward of log1p there is 0 * inf = NaN: every parameter gets NaN gradients and one
optimizer step destroys the model.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
span_scorer = nn.Linear(64, 1)
with torch.no_grad():
    span_scorer.weight.mul_(30.0)  # a fresh scorer: confident at random
params = [*encoder.parameters(), *span_scorer.parameters()]
optimizer = torch.optim.AdamW(params, lr=1e-3)
tokens = torch.randn(6, 24, 16)
starts = torch.randint(0, 20, (6, 40))
lengths = torch.randint(1, 4, (6, 40))
gold = (torch.rand(6, 24) < 0.3).float()


def coverage_consistency(p_span, span_tokens, n_tokens, gold_tokens):
    log_survival = torch.log1p(-p_span.clamp(max=1.0 - 1e-6))
    per_token = torch.zeros(n_tokens, dtype=log_survival.dtype).scatter_add(0, span_tokens, log_survival)
    covered = 1 - per_token.exp()
    return F.mse_loss(covered.float(), gold_tokens)


for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = encoder(tokens[step])
        s, e = starts[step], starts[step] + lengths[step]
        p_span = torch.sigmoid(span_scorer(torch.cat([h[s], h[e]], dim=-1))).squeeze(-1)
        loss = coverage_consistency(p_span, s, 24, gold[step])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
