"""One format's replay of the sample batches, and where it breaks.

A replay runs the op-level diagnosis (``diagnose_step``: the traced low-precision step beside its fp32
shadow) on a copy of the model prepared for the format, once per batch.  A trained format is prepared
by the engine itself (``Engine(name, keep_fp32=..., fp8_filter=...).prepare``), so a policy is tried
exactly as training would apply it; a what-if format swaps its eligible Linear layers for the emulated
ones of ``diagnose.core.blockcast`` and runs the rest under bf16 autocast.

A format breaks the model where (first one wins, in this order):

1. the diagnosis found an error (a non-finite value, an op that raised), or, for fp16, the loss scale
   overflowed the backward (``BACKWARD_OVERFLOW``: the scaler would skip the first steps);
2. a layer's input or weight flushes more of its values to zero than the format's ``thresholds.FORMAT_FLUSH``
   allows (the scaled formats; Transformer Engine's ``underflows%``; the doctor's FP8_FLUSH for the fp8
   recipes);
3. the model's output SQNR against fp32 falls below ``thresholds.FORMAT_OUTPUT_SQNR`` (19 dB; NVFP4 its own),
   beyond the borderline band: the loss reads the output, and an intermediate module's drop (a top-1 router flipping a few tokens in fp16) that does not
   reach it trains the same.  The break is placed at the first module, in forward order, below the
   format's own threshold (``thresholds.FORMAT_SQNR``);
4. the modules whose gradient SQNR is below the format's threshold carry most of the fp32 gradient's
   energy (``GRADIENT_SHARE``): most of the update is wrong.  A damaged gradient that carries little of it
   (a near one-hot attention's query and key) trains the same, so neither one module's gradient SQNR
   nor flushed values in a grad_output break a format by themselves.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ampkit.diagnose.core.blockformats import is_block_format
from ampkit.diagnose.core.gemm_emulation import EmulatedGemms, gemms_slow
from ampkit.diagnose.preflight.formats import FORMAT_SPECS
from ampkit.diagnose.preflight.result import Break, GemmPath, Policy
from ampkit.diagnose.preflight.steps import Autocast, PreflightStep
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.diagnose.step.session import copy_model
from ampkit.engine import Engine
from ampkit.fp8 import fp8_layer_names
from ampkit.precision import FormatName, Precision
from ampkit.thresholds import FORMAT_FLUSH, FORMAT_OUTPUT_SQNR, FORMAT_SQNR

__all__ = ["GRADIENT_SHARE", "Replay", "breaks_of", "forward_location", "quiet_fp8_warnings", "replay_format"]

_BREAKING_WARNINGS = frozenset({"FP8_FLUSH", "GRADIENT_UNDERFLOW"})
GRADIENT_SHARE = 0.5
"""A format breaks the backward when the modules its gradient SQNR rule reports hold more than this share of
the fp32 gradient's energy: most of the update is then wrong.  A damaged gradient that carries little of the
update (the query and key of a near one-hot attention) trains the same (the preflight corpus)."""


@dataclass(kw_only=True)
class Replay:
    """One format's diagnosis of every batch."""

    format: FormatName
    policy: Policy
    model: nn.Module
    """The prepared copy the batches were replayed on (module names as in the user's model)."""
    source: nn.Module
    """The user's model: where a break's module is defined (its class's ``forward``)."""
    results: list[DiagnosisResult] = field(default_factory=list)
    quantized: list[str] = field(default_factory=list)
    """The Linear layers computed in the format (fp8 recipes and block formats)."""
    forward_sqnr: dict[str, float] = field(default_factory=dict)
    """Module -> its lowest forward-output SQNR (dB) over the batches, forward order."""
    grad_sqnr: dict[str, float] = field(default_factory=dict)
    grad_global_sqnr: float = float("nan")
    """The SQNR of all parameter gradients together, the lowest over the batches (reported, not judged)."""
    gemm: GemmPath = "native"
    """How the format's GEMMs were computed (``replay_format``'s ``emulate``)."""

    @property
    def lowest_sqnr(self) -> float | None:
        """The lowest module forward-output SQNR (dB): what the SQNR rule judges."""
        values = [v for v in self.forward_sqnr.values() if not math.isnan(v)]
        return min(values) if values else None


def replay_format(model: nn.Module, steps: Sequence[PreflightStep], fmt: FormatName, policy: Policy, *,
                  device: torch.device, loss_scale: float | None, bisect: bool, emulate: bool | None = None) -> Replay:
    """Diagnose each step under ``fmt`` with ``policy`` applied (see the module docstring).

    ``emulate``: compute the format's GEMMs in fp32 on the low-precision operands (``EmulatedGemms``, entered
    around the diagnosis, so its op tracer sees the GEMMs as the format runs them); None: where this CPU
    computes the format's compute dtype slowly (``gemms_slow``: fp16 without fp16 units, bf16 and the formats
    that run in bf16 around their scaled GEMMs without bf16 units)."""
    work, precision, autocast, quantized = _prepare(model, fmt, policy, device)
    if emulate is None:
        emulate = gemms_slow(autocast[1], device)
    replay = Replay(format=fmt, policy=policy, model=work, source=model, quantized=quantized,
                    gemm="emulated" if emulate else "native")
    threshold = FORMAT_SQNR[fmt].threshold
    for step in steps:
        with EmulatedGemms() if emulate else contextlib.nullcontext():
            result = step.diagnose(work, precision, autocast, loss_scale=loss_scale, bisect=bisect,
                                   sqnr_threshold_db=threshold)
        replay.results.append(result)
        _lowest(replay.forward_sqnr, result.comparison.get("output_sqnr_db", {}))
        _lowest(replay.grad_sqnr, result.comparison.get("grad_sqnr_db", {}))
        whole = float(result.comparison.get("grad_global_sqnr_db", float("nan")))
        if not math.isnan(whole) and not whole >= replay.grad_global_sqnr:
            replay.grad_global_sqnr = whole
    return replay


def _prepare(model: nn.Module, fmt: FormatName, policy: Policy, device: torch.device
             ) -> tuple[nn.Module, Precision, Autocast, list[str]]:
    work = copy_model(model)
    if FORMAT_SPECS[fmt].trained:
        engine = Engine(fmt, device=device, keep_fp32=policy.keep_fp32, fp8_filter=policy.fp8_filter or None)
        work = engine.prepare(work)
        prec = engine.precision
        return work, prec, (device.type, prec.dtype, prec.autocast_enabled), fp8_layer_names(work)
    from ampkit.diagnose.core.blockcast import (
        to_block_format,  # torchao's MX modules: the what-if formats only
    )

    if not is_block_format(fmt):
        raise ValueError(f"format {fmt!r} is neither an engine precision nor a block format")
    quantized = to_block_format(work, fmt, exclude=policy.fp8_filter)
    # torchao's MX and NVFP4 training run the rest of the model in bf16; keeping a layer out of the
    # format is then what fp8_filter means for the float8 recipes, so the replay runs as an fp8 one.
    return work, Precision.parse("fp8", device), (device.type, torch.bfloat16, True), quantized


def _lowest(into: dict[str, float], values: dict[str, float]) -> None:
    for name, v in values.items():
        old = into.get(name)
        if old is None or (not math.isnan(v) and (math.isnan(old) or v < old)):
            into[name] = v


def breaks_of(replay: Replay, grad_energy: dict[str, float], flushes: dict[str, dict[str, float]] | None = None
              ) -> list[Break]:
    """Where ``replay`` breaks the model, worst kind first (see the module docstring).

    ``grad_energy``: module -> its fp32 gradient's squared norm (``Fp32Pass.grad_energy``); ``flushes``: layer
    -> operand -> the share of its non-zero values the format flushes (block formats, whose layers the
    diagnosis has no fp8 statistics for)."""
    found: list[Break] = []
    for result in replay.results:
        for f in result.findings:
            scaling = f.code == "BACKWARD_OVERFLOW" and f.severity == "info" and replay.format == "fp16"
            breaking = f.code in _BREAKING_WARNINGS and f.severity == "warning"
            if f.code == "FP8_FLUSH" and f.evidence.get("operand") == "grad_output":
                breaking = False  # a gradient's damage is judged on the whole gradient, below
            if f.severity == "error" or scaling or breaking:
                found.append(Break(kind="loss_scale" if scaling else "error", module=f.module, op=f.op,
                                   location=f.location, reason=f"{f.code}: {f.message}"))
    flush_rule = FORMAT_FLUSH.get(replay.format)
    for layer, operands in (flushes or {}).items():
        for operand, share in operands.items():
            if flush_rule is not None and operand != "grad_output" and flush_rule.judge(share) == "reported":
                found.append(Break(kind="flush", module=layer, op=None, location=forward_location(replay.source, layer),
                                   reason=f"{share:.1%} of the {operand}'s non-zero values flush to zero in "
                                          f"{replay.format} (more than {flush_rule.threshold:.0%})"))
    found.extend(_output_break(replay))
    found.extend(_gradient_break(replay, grad_energy))
    return found


def _output_break(replay: Replay) -> list[Break]:
    """The forward rule: the model's output below ``FORMAT_OUTPUT_SQNR``, placed at the first module, in forward
    order, below the format's own threshold."""
    rule = FORMAT_SQNR[replay.format]
    output_rule = FORMAT_OUTPUT_SQNR[replay.format]
    output = replay.forward_sqnr.get("")
    if output is None or output_rule.judge(output) != "reported":
        return []
    first = next((m for m, v in replay.forward_sqnr.items() if m and rule.judge(v) == "reported"), "")
    return [Break(kind="sqnr", module=first, op=None, location=forward_location(replay.source, first),
                  reason=f"the model's output is {output:.1f} dB SQNR against fp32, below {output_rule.threshold:g} dB; "
                         f"the first module below {replay.format}'s {rule.threshold:g} dB is "
                         f"{first or 'the model itself'} ({replay.forward_sqnr.get(first, output):.1f} dB)")]


def _gradient_break(replay: Replay, grad_energy: dict[str, float]) -> list[Break]:
    """The gradient rule: modules whose gradient SQNR is below the format's threshold (at most the output
    rule's: a gradient is noisier than the forward it comes from) carry more than ``GRADIENT_SHARE`` of the
    fp32 gradient's energy.  Placed at the module whose backward starts the damage:
    the one after the last damaged module in forward order (backward runs the other way)."""
    own = FORMAT_SQNR[replay.format]
    rule = own.at(min(own.threshold, FORMAT_OUTPUT_SQNR[replay.format].threshold))
    total = sum(grad_energy.values())
    order = [m for m in replay.grad_sqnr if m in grad_energy]
    bad = [m for m in order if rule.judge(replay.grad_sqnr[m]) == "reported"]
    share = sum(grad_energy[m] for m in bad) / total if total > 0 else 0.0
    if share <= GRADIENT_SHARE:
        return []
    last = order.index(bad[-1])
    start = order[last + 1] if last + 1 < len(order) else bad[-1]
    return [Break(kind="gradient", module=start, op=None, location=forward_location(replay.source, start),
                  reason=f"{share:.0%} of the gradient (by its fp32 energy) is in modules below {replay.format}'s "
                         f"{rule.threshold:g} dB SQNR; the damage starts in the backward of {start}")]


def forward_location(model: nn.Module, name: str | None) -> str | None:
    """``file:line`` of the ``forward`` of the module ``name`` (its class's source), or None."""
    if name is None:
        return None
    with contextlib.suppress(AttributeError, TypeError, OSError):
        forward = type(model.get_submodule(name)).forward
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    return None


@contextlib.contextmanager
def quiet_fp8_warnings() -> Iterator[None]:
    """The engine warns once per fp8 engine that a CPU has no fp8 GEMM; preflight builds one per trial."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"precision='fp8.*' on the CPU")
        yield
