"""The framework watcher: mixed precision asked for through a framework's settings or driver object.

A framework resolves a precision request itself and may run something else, with at most a
warning among its logs:

* Hugging Face ``TrainingArguments(fp16=True)`` (built by the script or by ``HfArgumentParser``
  from ``--fp16``): Accelerate enables fp16 autocast only on an accelerator, so on a CPU the
  Trainer trains in fp32;
* ``Accelerator(mixed_precision=...)``, or, when the argument is left out, the
  ``ACCELERATE_MIXED_PRECISION`` environment variable (which ``accelerate launch`` sets from its
  ``--mixed_precision`` or its config file): ``'fp16'`` on a CPU trains in fp32 (no autocast, no
  scaler), ``'bf16'`` autocasts.  A script started directly never reads accelerate's config file,
  so a ``mixed_precision`` there that the run did not get is a request too;
* Lightning's ``Trainer(precision='16-mixed')`` (or ``PL_TRAINER_PRECISION``, which the Trainer
  reads for an argument the code leaves out): on a CPU Lightning replaces it with
  ``'bf16-mixed'``, so the run autocasts to bf16.

The objects need not be globals of the script (they usually live inside ``main()``), so their
construction is watched: ``__post_init__`` / ``__init__`` is wrapped once the script imports the
framework's module (the doctor never imports a framework itself).  An ``Accelerator`` that another
framework builds (the Trainer's own) is that framework's business, already watched through its
settings.  The requests go to the ``Frameworks`` service; MIXED_PRECISION_OFF (``script.mixed``)
judges them against what ran.  Cost: one wrapper call per object built.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services.frameworks import FrameworkRequest
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import accelerate_fp16_off

__all__ = ["FrameworkWatch"]

_ACCELERATE_DTYPES = {"fp16": "fp16", "bf16": "bf16"}
_LIGHTNING_MODULES = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")


class FrameworkWatch(Watcher):
    """The framework objects built by the script and the fp16/bf16 they ask for (``requests``, in build order)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self._patches: PatchSet | None = None

    @override
    def install(self, patches: PatchSet) -> None:
        self._patches = patches
        patches.after_import("transformers.training_args",
                             functools.partial(self._wrap_class, "TrainingArguments", "__post_init__", self._wrap_post_init))
        patches.after_import("accelerate.accelerator",
                             functools.partial(self._wrap_class, "Accelerator", "__init__", self._wrap_accelerator))
        for name in _LIGHTNING_MODULES:
            patches.after_import(name, functools.partial(self._wrap_class, "Trainer", "__init__", self._wrap_lightning))

    def _wrap_class(self, cls_name: str, method: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                    module: types.ModuleType) -> None:
        """Wrap ``cls_name.method`` of ``module`` (just imported) with ``make``, when the class defines it."""
        cls = getattr(module, cls_name, None)
        if isinstance(cls, type) and method in vars(cls) and self._patches is not None:
            self._patches.wrap(cls, method, make)

    # -- Hugging Face Trainer ---------------------------------------------------------------------------
    def _wrap_post_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __post_init__(args: Any, *a: Any, **kw: Any) -> None:
            orig(args, *a, **kw)
            if self.state.models.paused:
                return
            self.state.frameworks.use("Trainer")
            for field, dtype in (("fp16", "fp16"), ("bf16", "bf16")):
                if getattr(args, field, False) is True:
                    self.state.frameworks.add(FrameworkRequest(
                        setting=f"TrainingArguments({field}=True)", dtype=dtype, location=self.state.frames.caller(),
                        framework="Trainer"))
        return __post_init__

    # -- Accelerate -------------------------------------------------------------------------------------
    def _wrap_accelerator(self, orig: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(orig)

        def __init__(acc: Any, *a: Any, **kw: Any) -> None:
            orig(acc, *a, **kw)
            if self.state.models.paused or not self.state.frames.is_user(sys._getframe(1).f_code.co_filename):
                return  # built by another framework (the Trainer's own): its settings are watched
            try:
                arg = signature.bind(acc, *a, **kw).arguments.get("mixed_precision")
            except TypeError:
                arg = None
            self.state.frameworks.use("Accelerate")
            request = _accelerate_request(acc, arg, self.state.frames.caller())
            if request is not None:
                self.state.frameworks.add(request)
        return __init__

    # -- Lightning --------------------------------------------------------------------------------------
    def _wrap_lightning(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __init__(trainer: Any, *a: Any, **kw: Any) -> None:
            orig(trainer, *a, **kw)
            if self.state.models.paused:
                return
            self.state.frameworks.use("Lightning")
            if "precision" in kw:
                asked, setting = kw["precision"], f"Trainer(precision={kw['precision']!r})"
            else:
                asked = _lightning_env_precision(trainer)
                setting = (f"PL_TRAINER_PRECISION={asked} in the environment, read by the Trainer for the arguments the "
                           "code leaves out")
            request = _lightning_request(trainer, asked, setting, self.state.frames.caller())
            if request is not None:
                self.state.frameworks.add(request)
        return __init__


def _accelerate_request(acc: Any, arg: Any, location: str | None) -> FrameworkRequest | None:
    """What an ``Accelerator`` was asked for: its ``mixed_precision=`` argument, else the environment
    variable, else the ``mixed_precision`` of accelerate's default config file that a direct run ignores."""
    device = str(getattr(getattr(acc, "device", None), "type", "cpu"))
    env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    reason = turn_on = ""
    if arg is not None:
        value = str(arg).lower()
        setting, bf16 = f"Accelerator(mixed_precision={value!r})", "Accelerator(mixed_precision='bf16')"
    elif env:
        value = env.lower()
        setting = (f"ACCELERATE_MIXED_PRECISION={value} in the environment (which `accelerate launch` sets from its "
                   "--mixed_precision or its config file), read by the Accelerator")
        bf16 = "ACCELERATE_MIXED_PRECISION=bf16, e.g. `accelerate launch --mixed_precision bf16`"
    else:
        path, config_value = _config_file_precision()
        if path is None or config_value not in _ACCELERATE_DTYPES:
            return None
        value = config_value
        setting, bf16 = f"mixed_precision: {value} in accelerate's config file {path}, for the Accelerator", "bf16"
        reason = ("accelerate applies its config file only in `accelerate launch`, and this run started the script "
                  "directly, so Accelerator() used mixed_precision='no'")
        turn_on = (f"start the script through `accelerate launch`, or set the request where the script runs: "
                   f"`ACCELERATE_MIXED_PRECISION={value} ampkit doctor SCRIPT`, or Accelerator(mixed_precision={value!r})")
        if value == "fp16" and device == "cpu":
            turn_on += f" (on {device} fp16 would still train in fp32: {accelerate_fp16_off(device, bf16)[1]})"
    dtype = _ACCELERATE_DTYPES.get(value)
    if dtype is None:
        return None
    if not reason and dtype == "fp16" and not getattr(acc, "native_amp", False):
        reason, turn_on = accelerate_fp16_off(device, bf16)
    return FrameworkRequest(setting=setting, dtype=dtype, location=location, framework="Accelerate", reason=reason,
                            turn_on=turn_on)


def _config_file_precision() -> tuple[str | None, str | None]:
    """accelerate's default config file and its ``mixed_precision`` (None, None when there is none or it does not
    load).  Read with accelerate's own loader, which the script's ``import accelerate`` made importable."""
    try:
        config_args = importlib.import_module("accelerate.commands.config.config_args")
        path = str(config_args.default_config_file)
        if not os.path.isfile(path):
            return None, None
        value = getattr(config_args.load_config_from_file(path), "mixed_precision", None)
    except Exception:  # a config file the launcher itself would refuse: not this report's business
        return None, None
    return path, None if value is None else str(value).lower()


def _lightning_dtype(precision: Any) -> str | None:
    """``fp16``/``bf16`` for a Lightning precision that autocasts or stores weights in it (16, '16-mixed',
    'bf16-mixed', 'bf16-true', ...); None for 32/64-bit and plugins."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    return "fp16" if text in ("16", "16-mixed", "16-true") else None


def _lightning_env_precision(trainer: Any) -> Any:
    """The ``precision`` Lightning's Trainer took from ``PL_TRAINER_PRECISION`` (None when unset), parsed by
    Lightning's own reader next to the Trainer's package."""
    if "PL_TRAINER_PRECISION" not in os.environ:
        return None
    package = type(trainer).__module__.removesuffix(".trainer.trainer")
    try:
        parsed = importlib.import_module(f"{package}.utilities.argparse")._parse_env_variables(type(trainer))
    except Exception:  # a Lightning without that reader: the variable's text is what it asked for
        return os.environ["PL_TRAINER_PRECISION"]
    return getattr(parsed, "precision", None)


def _lightning_request(trainer: Any, precision: Any, setting: str, location: str | None) -> FrameworkRequest | None:
    dtype = _lightning_dtype(precision)
    if dtype is None:
        return None
    resolved = str(getattr(trainer, "precision", precision))
    reason = turn_on = ""
    if _lightning_dtype(resolved) != dtype:
        device = str(getattr(getattr(trainer.strategy, "root_device", None), "type", "cpu"))
        said = " (its one warning: 'AMP with fp16 is not supported on CPU')" if device == "cpu" else ""
        reason = f"Lightning replaced precision={precision!r} with {resolved!r} on {device}{said}"
        turn_on = (f"ask for precision={resolved!r}, so that the code says what runs on {device}, or run on a GPU for "
                   f"{dtype} (Lightning adds the GradScaler that fp16 needs)")
    return FrameworkRequest(setting=setting, dtype=dtype, location=location,
                            framework="Lightning", reason=reason, turn_on=turn_on)
