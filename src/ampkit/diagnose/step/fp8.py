"""The step doctor on a model with torchao ``Float8Linear`` layers: its precision, its shadow, its trials.

An fp8 engine (``MixedPrecision("fp8")``, or torchao's ``convert_to_float8_training`` in a script)
leaves ``Float8Linear`` layers in the model and runs the rest under bf16 autocast, so a replay sees
bf16 autocast.  Three things differ from a bf16 diagnosis:

* **the precision** is fp8 (``fp8_precision``): the recipe is read from the layers' own
  ``Float8LinearConfig`` (``fp8recipes.fp8_recipe_of``: gw-hp's high-precision weight-gradient GEMM
  tells it from rowwise), so PRECISION_LOSS is judged with fp8's threshold;
* **the fp32 shadow** must not cast to fp8: disabling autocast does not reach torchao's casts, so
  every ``Float8Linear`` of the shadow copy becomes a plain ``nn.Linear`` (``strip_fp8``);
* **a trial keeps modules out of fp8** instead of in fp32 (``out_of_fp8``): their ``Float8Linear``
  layers compute as ``nn.Linear`` under the same bf16 autocast, which is what ``fp8_filter=[...]``
  gives, and the verified set is printed as ``fp8_filter``.

A ``Float8Linear`` is an ``nn.Linear`` subclass that only overrides ``forward``; the switch assigns
``nn.Linear`` as the instance's class and back.  That keeps the parameters, the hooks and the module
names (the recorder's references stay valid) and costs nothing: no copy, no torchao call.

An emulated MXFP8/NVFP4 layer (``diagnose.core.blockcast.BlockFormatLinear``, what ``ampkit preflight``
replays its what-if formats with) is such a subclass too, and is stripped, kept out and listed the
same way: every walk here selects ``is_quantized_linear`` layers, a Linear in a low-precision GEMM
format.  Only the recipe (``fp8_recipe``) is read from ``Float8Linear`` layers alone.

torchao is never imported here: ``ampkit.fp8.is_float8_linear`` is False until it was imported by
whoever converted the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from ampkit.diagnose.core.blockcast import quantized_layer_names
from ampkit.fp8 import is_float8_linear
from ampkit.fp8recipes import fp8_recipe_of
from ampkit.policy import resolve_keep_fp32
from ampkit.precision import FP8_RECIPES, Fp8RecipeName, Precision

__all__ = ["filter_layers", "fp8_candidates_only", "fp8_precision", "fp8_recipe", "layers_to_filter", "out_of_fp8",
           "strip_fp8"]


def fp8_recipe(model: nn.Module) -> Fp8RecipeName | None:
    """``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"`` from the first ``Float8Linear``'s config
    (``fp8_recipe_of``); None without fp8 layers."""
    layer = next((m for m in model.modules() if is_float8_linear(m)), None)
    if layer is None:
        return None
    config: Any = layer.config
    return fp8_recipe_of(config)


def fp8_precision(precision: Precision, model: nn.Module) -> Precision:
    """``precision`` as fp8 when ``model`` holds ``Float8Linear`` layers (a bf16 replay of an fp8 run)."""
    recipe = fp8_recipe(model)
    if recipe is None or precision.is_fp8:
        return precision
    name = next(name for name, named in FP8_RECIPES.items() if named == recipe)
    return Precision.parse(name, precision.device)


def _layers_under(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The quantized Linear layers (``Float8Linear``, emulated block formats) that are, or sit inside, the
    named modules."""
    chosen = set(names)
    out = []
    for name in quantized_layer_names(model):
        parts = name.split(".") if name else []
        if any(".".join(parts[:i]) in chosen for i in range(len(parts) + 1)):
            out.append(model.get_submodule(name))
    return out


@contextlib.contextmanager
def out_of_fp8(model: nn.Module, names: Sequence[str]) -> Iterator[list[nn.Module]]:
    """Run the quantized Linear layers in or under ``names`` as ``nn.Linear`` until the block ends."""
    layers = _layers_under(model, names)
    classes = [type(m) for m in layers]
    for m in layers:
        m.__class__ = nn.Linear
    try:
        yield layers
    finally:
        for m, cls in zip(layers, classes):
            m.__class__ = cls


def strip_fp8(model: nn.Module) -> nn.Module:
    """Turn every quantized Linear of ``model`` (a private copy) into ``nn.Linear`` for good; returns it."""
    for m in _layers_under(model, [""]):
        m.__class__ = nn.Linear
    return model


def filter_layers(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The quantized Linear layers ``fp8_filter=patterns`` keeps out of fp8, resolved as the engine does."""
    matched = resolve_keep_fp32(model, list(patterns), what="fp8_filter")
    layers = {id(m) for m in _layers_under(model, matched)}
    return [n for n in quantized_layer_names(model) if id(model.get_submodule(n)) in layers]


def fp8_candidates_only(model: nn.Module, order: Sequence[str], candidates: list[str], scan: list[str] | None,
                        limit: int) -> tuple[list[str], list[str] | None]:
    """The bisection's candidates and effect scan narrowed to ``model``'s quantized Linear layers (forward
    order): only they can be filtered out of fp8, and a filter per layer is the one to paste."""
    layers = set(quantized_layer_names(model))
    ordered = [n for n in dict.fromkeys(order) if n in layers]
    narrowed = list(dict.fromkeys([*(c for c in candidates if c in layers), *ordered]))
    return narrowed, (ordered[:limit] if scan is not None else None)


def layers_to_filter(module: str, fp8_layers: Sequence[str], order: Sequence[str], *, gradient: bool) -> list[str]:
    """The fp8 layers to keep out of fp8 for a PRECISION_LOSS at ``module`` (forward ``order``).

    ``module`` itself when it is or holds an fp8 layer; otherwise the fp8 layer its values came
    through: for an activation the nearest one before it in forward order, for a gradient the
    nearest one after it (the gradient comes back through that layer's backward).  Empty when
    there is none.

    >>> layers = ["body.0", "head"]
    >>> order = ["body.0", "body", "norm", "head", ""]
    >>> layers_to_filter("head", layers, order, gradient=False), layers_to_filter("body", layers, order, gradient=True)
    (['head'], ['body'])
    >>> layers_to_filter("norm", layers, order, gradient=True), layers_to_filter("norm", layers, order, gradient=False)
    (['head'], ['body.0'])
    """
    if module and any(n == module or n.startswith(module + ".") for n in fp8_layers):
        return [module]
    names = list(dict.fromkeys(order))
    if module not in names:
        return []
    at = names.index(module)
    side = names[at + 1:] if gradient else reversed(names[:at])
    return next(([n] for n in side if n in set(fp8_layers)), [])
