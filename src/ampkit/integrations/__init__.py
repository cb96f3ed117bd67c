"""Integrations with training frameworks that drive their own loop.

Each framework has its own module, imported only on demand and behind an optional extra, so that
``import ampkit`` never loads transformers or lightning:

- ``ampkit.integrations.hf``: a ``transformers.TrainerCallback`` (``pip install ampkit[hf]``);
- ``ampkit.integrations.accelerate``: ``watch(accelerator, model, optimizer, ...)`` for Accelerate loops
  written by hand (``pip install ampkit[hf]``);
- ``ampkit.integrations.lightning``: a ``Precision`` plugin and an observe-only callback for
  ``lightning.pytorch`` (``pip install ampkit[lightning]``).

They attach through the engine's hooks or through ``ampkit.telemetry.observe``; none patches the engine.
"""

__all__: list[str] = []
