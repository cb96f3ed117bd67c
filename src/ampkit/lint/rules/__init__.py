"""The rule catalog, AMP101–AMP120, in code order.

| code | rule |
|---|---|
| AMP101 | deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` API (``--fix`` rewrites it) |
| AMP102 | gradient clipping after ``scaler.scale(...).backward()`` with no ``unscale_`` before it |
| AMP103 | ``scaler.update()`` / ``unscale_()`` / ``step()`` off the accumulation boundary |
| AMP104 | checkpoint with model/optimizer state but no scaler state while a scaler exists |
| AMP105 | a constant outside the fp16 range written into a tensor that may be fp16 |
| AMP106 | ``log(softmax(x))``, ``log(sigmoid(x))``, BCE on a sigmoid output |
| AMP107 | a whole model converted to fp16/bf16 and trained |
| AMP108 | ``optimizer.step()`` or ``.backward()`` inside an autocast block |
| AMP109 | custom ``autograd.Function`` without ``custom_fwd``/``custom_bwd`` in a file using autocast |
| AMP110 | ``torch.is_autocast_enabled()`` without a device |
| AMP111 | GradScaler with bf16 autocast |
| AMP112 | fp16 autocast in training with no loss scaling |
| AMP113 | ``torch.load`` without ``weights_only=True`` |
| AMP114 | a running accumulator kept in fp16/bf16 |
| AMP115 | ``lr_scheduler.step()`` unconditionally after ``scaler.step()`` |
| AMP116 | a path that skips ``scaler.update()`` after ``step()`` / ``unscale_()`` |
| AMP117 | fp8 training in a file that never compiles the model |
| AMP118 | FSDP2 fp8 all-gather with no ``precompute_float8_dynamic_scale_for_fsdp`` in the file |
| AMP119 | ``precompute_float8_dynamic_scale_for_fsdp`` before the optimizer step in the loop |
| AMP120 | ``convert_to_float8_training`` after ``fully_shard`` |
"""

from __future__ import annotations

from ampkit.lint.core import Rule
from ampkit.lint.rules import api, checkpoint, fp8, numerics, precision, scaler, training

__all__ = ["RULES", "RULES_BY_CODE"]

RULES: tuple[Rule, ...] = tuple(sorted((*api.RULES, *scaler.RULES, *checkpoint.RULES, *precision.RULES,
                                        *numerics.RULES, *training.RULES, *fp8.RULES),
                                       key=lambda r: r.code))
RULES_BY_CODE: dict[str, Rule] = {r.code: r for r in RULES}
