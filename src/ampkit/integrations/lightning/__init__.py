"""Lightning integration (``pip install ampkit[lightning]``): a precision plugin and an observe-only callback.

* ``AmpkitPrecision(precision, keep_fp32=..., scaler=..., hooks=...)``: a
  ``lightning.pytorch.plugins.Precision`` for ``Trainer(plugins=[...])`` that runs the ampkit
  engine inside Lightning's loop: autocast, loss scaling, the documented step order (unscale ->
  clip -> step or skip -> scale update), keep-fp32 rules, and a step-interval LR scheduler that
  is not stepped on a skipped step.  ``"16-mixed"`` trains in fp16 with loss scaling on CPU too,
  and fp16 works with a fused optimizer and ``gradient_clip_val``.
* ``AmpkitCallback(telemetry=..., doctor=...)``: for a run that keeps Lightning's own precision
  plugin; records ampkit's telemetry per optimizer step through ``ampkit.telemetry.observe``.

Importing this module imports ``lightning``; ``import ampkit`` does not.  See docs/integrations.md.
"""

from __future__ import annotations

try:  # every submodule imports this package first, so this is the one place that can say what is missing
    import lightning.pytorch  # noqa: F401
except ImportError as exc:  # pragma: no cover - the dev extra installs lightning
    raise ImportError(
        "ampkit.integrations.lightning needs the lightning package (lightning.pytorch): "
        "pip install 'ampkit[lightning]'"
    ) from exc

from ampkit.integrations.lightning.callback import AmpkitCallback
from ampkit.integrations.lightning.precision import AmpkitPrecision

__all__ = ["AmpkitCallback", "AmpkitPrecision"]
