"""fp8 training on torchao's float8 recipes: which Linear layers convert, and the conversion.

An fp8 engine (``"fp8"`` = ``"fp8-tensorwise"``, ``"fp8-rowwise"`` or ``"fp8-rowwise-gw-hp"``)
replaces ``nn.Linear`` layers by torchao's ``Float8Linear`` in ``prepare`` and runs everything else
under bf16 autocast, with fp32 master weights and no loss scaler.  The algorithm of
``Fp8Converter.convert``:

1. Choose the layers: every ``nn.Linear`` whose in and out features are both multiples of 16
   (CUDA's fp8 GEMM requires it; ampkit checks it on every device so that CPU and GPU convert
   the same layers), minus those inside a ``keep_fp32`` module (the layer itself or any module
   above it), narrowed by ``fp8_filter`` (``check_fp8_filter`` lists its forms).
2. Build torchao's ``Float8LinearConfig`` for the recipe (``from_recipe_name``), with
   ``emulate=True`` on CUDA below compute capability 8.9 and torch's CPU ``_scaled_mm`` on CPU.
3. ``torchao.float8.convert_to_float8_training`` swaps the chosen layers.  It swaps in place,
   except that a model which *is* an ``nn.Linear`` comes back as a new object: always train the
   returned model.
4. A layer whose recipe feeds its input to a GEMM uncast (``rowwise_with_gw_hp``'s weight-gradient
   GEMM) gets ``fp8recipes.autocast_input`` as a forward pre-hook: without it, that recipe raises
   under CPU autocast (``ampkit.fp8recipes`` says why).

torchao is imported only through this module (``import_torchao``), on the first conversion or
emulated block-format cast: building a non-fp8 engine, ``ampkit verify`` or ``ampkit doctor``
never imports it (about 2 s, and a few log lines, see ``import_torchao``).

>>> import torch
>>> from ampkit.precision import FP8_RECIPES, Precision
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
>>> fp8_candidates(model, Precision.parse("fp8", "cpu"))
['0']
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._util.frames import UserFrames
from ampkit.fp8recipes import hook_autocast_input, named_recipe
from ampkit.policy import KeepFp32Rule, resolve_keep_fp32, rule_names
from ampkit.precision import FP8_RECIPES, Precision

__all__ = [
    "FP8_EXTRA",
    "FP8_GEMM_CAPABILITY",
    "Fp8Converter",
    "Fp8Filter",
    "Fp8FilterSpec",
    "check_fp8_filter",
    "describe_fp8_filter",
    "fp8_candidates",
    "fp8_layer_names",
    "has_fp8_gemm",
    "import_torchao",
    "is_float8_linear",
    "require_torchao",
    "torchao_installed",
]

Fp8Filter = Sequence[KeepFp32Rule] | Callable[[nn.Module, str], bool] | str | None
"""What ``fp8_filter=`` accepts (see ``check_fp8_filter``)."""
Fp8FilterSpec = tuple[KeepFp32Rule, ...] | Callable[[nn.Module, str], bool] | str
"""A checked ``fp8_filter``: a tuple of rules (empty: the default), a callable, or ``"auto"``."""

FP8_EXTRA = "pip install 'ampkit[fp8]'"
"""How to install torchao at the version range ampkit is tested with."""
FP8_GEMM_CAPABILITY = (8, 9)
"""The CUDA compute capability from which ``torch._scaled_mm`` has fp8 kernels (Ada, Hopper, Blackwell)."""
_MULTIPLE = 16

_VALID_FORMS = (
    "None (every nn.Linear whose in/out features are multiples of 16, outside keep_fp32); "
    "a list of module name patterns or nn.Module types to keep out of fp8 (keep_fp32's syntax, e.g. "
    "['lm_head', '*.attn.*'] or [nn.Embedding]); a callable (module, fqn) -> bool returning True to "
    "convert (torchao's module_filter_fn); or 'auto' (torchao's size heuristics, which skip small GEMMs)"
)


def check_fp8_filter(value: Fp8Filter) -> Fp8FilterSpec:
    """Check ``fp8_filter=`` and return its normal form; raise ``TypeError``/``ValueError`` naming the valid forms.

    >>> check_fp8_filter(["lm_head", nn.LayerNorm])
    ('lm_head', <class 'torch.nn.modules.normalization.LayerNorm'>)
    >>> check_fp8_filter("lm_head")
    Traceback (most recent call last):
    ...
    ValueError: fp8_filter='lm_head': the only string accepted is 'auto'; to keep one module out of fp8 wrap its pattern in a list, fp8_filter=['lm_head']. Valid forms: None (every nn.Linear ...
    """
    if value is None:
        return ()
    if isinstance(value, str):
        if value == "auto":
            return value
        raise ValueError(f"fp8_filter={value!r}: the only string accepted is 'auto'; to keep one module out of "
                         f"fp8 wrap its pattern in a list, fp8_filter=[{value!r}]. Valid forms: {_VALID_FORMS}")
    if isinstance(value, type):
        hint = f"fp8_filter=[{value.__name__}]" if issubclass(value, nn.Module) else "one of the valid forms"
        raise TypeError(f"fp8_filter={value.__name__}: a type must be inside a list ({hint}). Valid forms: {_VALID_FORMS}")
    if callable(value) and not isinstance(value, nn.Module):
        return value
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"fp8_filter={value!r} ({type(value).__name__}) is not a filter. Valid forms: {_VALID_FORMS}")
    for i, rule in enumerate(value):
        if not (isinstance(rule, str) or (isinstance(rule, type) and issubclass(rule, nn.Module))):
            raise TypeError(f"fp8_filter[{i}]={rule!r} is neither a module name pattern (str) nor an nn.Module "
                            f"type. Valid forms: {_VALID_FORMS}")
    return tuple(value)


def describe_fp8_filter(spec: Fp8FilterSpec) -> Any:
    """``spec`` as a JSON-able value (ranks compare it; ``repr`` shows it): None for the default.

    >>> describe_fp8_filter(()), describe_fp8_filter("auto"), describe_fp8_filter(("lm_head", nn.LayerNorm))
    (None, 'auto', ['lm_head', 'torch.nn.modules.normalization.LayerNorm'])
    """
    if isinstance(spec, str):
        return spec
    if isinstance(spec, tuple):
        return rule_names(spec) or None
    return f"{getattr(spec, '__module__', '?')}.{getattr(spec, '__qualname__', type(spec).__qualname__)}"


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (False while torchao was never imported)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def fp8_layer_names(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s ``Float8Linear`` layers, in model order (``""``: the model itself)."""
    return [name for name, m in model.named_modules() if is_float8_linear(m)]


def fp8_candidates(
    model: nn.Module, precision: Precision, *, keep_fp32: Sequence[KeepFp32Rule] = (), fp8_filter: Fp8Filter = None,
) -> list[str]:
    """The dotted names of the ``nn.Linear`` layers an fp8 engine converts, in model order.

    Only ``fp8_filter="auto"`` imports torchao (its heuristics live there).
    """
    spec = check_fp8_filter(fp8_filter)
    kept = set(resolve_keep_fp32(model, keep_fp32)) if keep_fp32 else set()
    if isinstance(spec, tuple) and spec:
        kept |= set(resolve_keep_fp32(model, spec, what="fp8_filter"))
    decide: Callable[[nn.Module, str], bool] | None = None
    if spec == "auto":
        # torchao 0.18's _auto_filter_for_recipe raises NotImplementedError for rowwise_with_gw_hp, so it
        # takes rowwise's size rules (its forward GEMM is rowwise's).  Its weight-gradient GEMM stays bf16:
        # it gains less from fp8 than rowwise, and a layer just past rowwise's sizes may gain nothing.
        recipe = "rowwise" if precision.fp8_recipe == "rowwise_with_gw_hp" else precision.fp8_recipe
        decide = _import_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])
    elif callable(spec):
        decide = spec
    chosen = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or is_float8_linear(module):
            continue
        parts = fqn.split(".") if fqn else []
        if any(".".join(parts[:i]) in kept for i in range(len(parts) + 1)):
            continue  # a keep_fp32 (or fp8_filter) module, or one inside it
        if module.in_features % _MULTIPLE or module.out_features % _MULTIPLE:
            continue
        if decide is None or decide(module, fqn):
            chosen.append(fqn)
    return chosen


def has_fp8_gemm(device: torch.device) -> bool:
    """True on CUDA devices whose ``torch._scaled_mm`` has fp8 kernels (compute capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_GEMM_CAPABILITY


def torchao_installed() -> bool:
    """Whether torchao can be imported, found without importing it (the import costs about 2 s)."""
    return importlib.util.find_spec("torchao") is not None


def _emulate(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_GEMM_CAPABILITY


def import_torchao(module: str) -> Any:
    """``import module`` (a torchao module, e.g. ``torchao.float8``), with its import-time warnings held back.

    On a CPU-only torch torchao logs "Failed to load .../_C_*.so" for its CUDA kernel libraries
    (none of which float8 training or the MX/NVFP4 casts use) and torch logs a pytree deprecation
    for each of torchao's enums, on every process that imports it.  They say nothing about the
    user's run, so they are raised to ERROR for the import only; the levels are restored afterwards
    and errors still pass.  Raises ``ImportError`` naming ``ampkit[fp8]`` when the import fails.
    """
    if module in sys.modules:
        return sys.modules[module]
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except Exception as exc:  # a broken install fails in many ways: a missing symbol, a version clash
        raise ImportError(
            f"torchao is installed but `import {module}` fails ({type(exc).__name__}: {exc}); install a "
            f"working one with `{FP8_EXTRA}` (torchao 0.18), or use precision='bf16'"
        ) from exc
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _import_float8() -> Any:
    """``import torchao.float8`` (and its ``Float8Linear`` module, which ``is_float8_linear`` looks up)."""
    import_torchao("torchao.float8.float8_linear")
    return import_torchao("torchao.float8")


class Fp8Converter:
    """The fp8 side of one engine: converts the models passed to ``prepare``; a no-op for other precisions.

    Building one for an fp8 precision checks that torchao is installed (without importing it) and
    warns when the device has no fp8 GEMM.
    """

    def __init__(self, precision: Precision, *, keep_fp32: Sequence[KeepFp32Rule] = (),
                 fp8_filter: Fp8Filter = None) -> None:
        self.precision = precision
        self.keep_fp32 = tuple(keep_fp32)
        self.fp8_filter = check_fp8_filter(fp8_filter)
        self.layers: list[str] = []
        """The ``Float8Linear`` layers of the last converted model, by dotted name (empty: none)."""
        if precision.is_fp8:
            _require_torchao(precision)
            _warn_without_fp8_gemm(precision)

    @property
    def enabled(self) -> bool:
        """Whether ``convert`` converts anything (the precision is fp8)."""
        return self.precision.is_fp8

    def torchao_config(self, *, all_gather: bool = False) -> Any:
        """torchao's ``Float8LinearConfig`` for the recipe, the device's kernels and FSDP2's fp8 all-gather."""
        recipe = self.precision.fp8_recipe
        if recipe is None:
            raise ValueError(f"precision {self.precision.name!r} is not an fp8 precision; use one of "
                             f"{', '.join(map(repr, FP8_RECIPES))}")
        if all_gather:
            self._check_all_gather(nn.Module())
        config = _import_float8().Float8LinearConfig.from_recipe_name(recipe)
        return dataclasses.replace(config, emulate=_emulate(self.precision.device),
                                   enable_fsdp_float8_all_gather=all_gather)

    def convert(self, model: nn.Module, *, all_gather: bool = False) -> nn.Module:
        """Convert ``model``'s chosen Linear layers (see the module docstring); returns the model to train.

        Layers converted before (by ``ampkit.distributed.shard``) stay as they are, so converting
        twice is a no-op.  Warns when the model ends up with no fp8 layer.
        """
        if not self.enabled:
            return model
        self._check_converted_recipe(model)
        if all_gather:
            self._check_all_gather(model)
        chosen = set(fp8_candidates(model, self.precision, keep_fp32=self.keep_fp32, fp8_filter=self.fp8_filter))
        modules = dict(model.named_modules())
        sharded = sorted(n for n in chosen if any(hasattr(p, "to_local") for p in modules[n].parameters()))
        if sharded:
            # torchao's layers would then meet DTensor weights with plain activations and fail in the
            # first forward ("aten.mm.default got mixed torch.Tensor and DTensor").
            raise RuntimeError(
                f"precision={self.precision.name!r}: the Linear layers {sharded[:4]} are already sharded (FSDP2), "
                "and fp8 conversion must come before fully_shard. Shard with ampkit.distributed.shard(model, mp), "
                "which converts first, and pass its result to mp.prepare"
            )
        if chosen:
            config = self.torchao_config(all_gather=all_gather)
            model = _import_float8().convert_to_float8_training(
                model, config=config, module_filter_fn=lambda _module, fqn: fqn in chosen,
            )
        self.layers = fp8_layer_names(model)
        for layer in (model.get_submodule(name) for name in self.layers):  # converted here or by hand
            hook_autocast_input(layer)
        if not self.layers:
            linears = sum(isinstance(m, nn.Linear) for m in model.modules())
            warnings.warn(
                f"precision={self.precision.name!r}: no Linear layer was converted to fp8 (the model has {linears} "
                f"nn.Linear; fp8 takes those whose in and out features are both multiples of {_MULTIPLE}, outside "
                "keep_fp32 and fp8_filter, and fp8_filter='auto' skips every GEMM too small to gain). The model "
                "trains in bf16 autocast only; use precision='bf16' for it, or widen the layers or the filter",
                UserWarning, stacklevel=_user_stacklevel(),
            )
        return model

    def _check_converted_recipe(self, model: nn.Module) -> None:
        """Refuse ``Float8Linear`` layers converted by hand with another recipe than the engine's.

        Adopting their recipe would make the engine's precision (fixed at construction, recorded in
        checkpoints, reports and the descriptor ranks compare) depend on the model; refusing keeps
        one name for one recipe.  Only the casts are compared: ``emulate`` and the FSDP all-gather
        follow the device and the sharding, not the recipe.
        """
        layers = fp8_layer_names(model)
        if not layers:
            return
        f8 = _import_float8()  # already imported: the model holds its layers
        want = self.precision.fp8_recipe
        modules = dict(model.named_modules())
        wrong = [n for n in layers if named_recipe(f8, modules[n].config) != want]
        if not wrong:
            return
        got = named_recipe(f8, modules[wrong[0]].config)
        name = self.precision.name
        how = f"torchao's {got!r} recipe" if got else "a Float8LinearConfig that is none of torchao's named recipes"
        unconverted = "or pass the model unconverted to mp.prepare, which converts it with the engine's recipe"
        ours = {recipe: prec for prec, recipe in FP8_RECIPES.items()}
        if got in ours:
            fix = f"use MixedPrecision({ours[got]!r}) for this model, {unconverted}"
        else:
            listed = ", ".join(f"{prec!r} ({recipe})" for prec, recipe in FP8_RECIPES.items())
            fix = f"ampkit has no precision for it (it trains {listed}); convert with one of those recipes, {unconverted}"
        raise ValueError(
            f"mp.prepare(model): precision={name!r} trains torchao's {want!r} recipe, but the model's Float8Linear "
            f"layers {wrong[:4]} were converted with {how} (convert_to_float8_training by hand); training them "
            f"under {name!r} would record {name!r} in checkpoints and reports for another recipe. To fix: {fix}"
        )

    def _check_all_gather(self, model: nn.Module) -> None:
        if self.precision.fp8_recipe != "tensorwise":
            raise ValueError(
                f"fp8_all_gather=True with precision={self.precision.name!r}: torchao all-gathers fp8 weights only "
                "with tensorwise scaling (one scale per weight, precomputed after each step). Use precision='fp8' "
                f"with fp8_all_gather=True, or keep {self.precision.name!r} and drop fp8_all_gather"
            )
        without = [n for n, m in model.named_modules()
                   if is_float8_linear(m) and not m.config.enable_fsdp_float8_all_gather]
        if without:
            raise ValueError(
                f"fp8_all_gather=True, but the layers {without[:4]} were converted to fp8 without it (mp.prepare ran "
                "before shard); build the model, call ampkit.distributed.shard(model, mp, fp8_all_gather=True), "
                "then mp.prepare(model)"
            )

    def __repr__(self) -> str:
        return f"Fp8Converter({self.precision.name!r}, layers={len(self.layers)})"


def require_torchao(precision: Precision) -> None:
    """Import torchao's float8 training now (about 2 s), for a check before anything trains: raise
    ``ImportError`` naming ``ampkit[fp8]`` when torchao is missing or fails to import."""
    _require_torchao(precision)
    _import_float8()


def _require_torchao(precision: Precision) -> None:
    if not torchao_installed():
        raise ImportError(
            f"precision={precision.name!r} trains with torchao's float8 layers, and torchao is not installed; "
            f"install it with `{FP8_EXTRA}` (torchao 0.18), or use precision='bf16'"
        )


def _warn_without_fp8_gemm(precision: Precision) -> None:
    dev = precision.device
    if dev.type == "cuda" and not _emulate(dev):
        return
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        where = f"{dev} (compute capability {major}.{minor}, below {FP8_GEMM_CAPABILITY[0]}.{FP8_GEMM_CAPABILITY[1]})"
        how = "torchao's emulation (emulate=True: fp8 rounding of the operands, matmuls in higher precision)"
    else:
        where, how = "the CPU", "torch's CPU _scaled_mm kernel"
    warnings.warn(
        f"precision={precision.name!r} on {where}: there is no fp8 GEMM here, so the fp8 layers run on {how}. "
        "The numerics are fp8's but each converted matmul is slower than in bf16; use it to check fp8 training, "
        "and a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell) for speed",
        UserWarning, stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost user frame: the warnings name the user's line whether they
    came through ``Engine``, ``MixedPrecision``, ``prepare`` or ``ampkit.distributed.shard``."""
    frames = UserFrames()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and not frames.is_user(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
