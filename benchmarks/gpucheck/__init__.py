"""The CUDA check behind ``benchmarks/gpu_check.py``: one short run that proves ampkit's CUDA paths.

One module per section (``bitexact``, ``nosync``, ``ratios``, ``replay``, ``verify``, ``nccl``,
``frameworks``, and ``fp8``, which only ``--only fp8`` runs), each with ``run(device, *, tiny) ->
list[Check]``; ``table`` holds the sections' time caps and the pass/fail thresholds, ``runner`` runs
each section in its own process under its cap, ``report`` writes ``gpu-check.json`` and
``gpu-check.md``; ``fp8recipe`` is torchao's float8 recipe written out, shared with the tests.  Every section takes a device, so
the CPU tests run each one on cpu at tiny size (``nosync`` needs CUDA's sync-debug mode and
``nccl`` a CUDA process group: the CPU tests drive their code with a stand-in guard and gloo).
"""
