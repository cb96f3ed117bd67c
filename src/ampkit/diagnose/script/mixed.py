"""Mixed precision asked for versus what ran: MIXED_PRECISION_OFF and the doctor JSON's
``mixed_precision`` record.

A script asks for mixed precision in three ways the watchers see: a GradScaler (which torch
turns off without CUDA, with one warning among the logs), an autocast object (built, perhaps
never entered), and a setting that names a low-precision dtype or switches AMP on (``dtype =
'float16'``, ``args.amp``).  What ran is what the model watcher saw: forwards under autocast,
or low-precision parameters.  A script whose every switch is off (``enabled=False``) asked for
nothing: it trains in fp32 on purpose, and only the summary line says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ampkit._util.dtypes import dtype_name
from ampkit.findings import Finding, Severity, accelerate_fp16_off, mixed_precision_off
from ampkit.precision import LOW_PRECISION_DTYPES

if TYPE_CHECKING:
    from ampkit.diagnose.script.context import Context
    from ampkit.diagnose.script.services.scalers import ScalerInfo

__all__ = ["fp32_note", "mixed_precision_record", "report_mixed_precision_off", "requested_flags",
           "scaler_off_too", "trained_in"]

_LOW_VALUES = frozenset({"float16", "bfloat16", "fp16", "bf16", "half", "16", "16-mixed", "bf16-mixed",
                         "16-true", "bf16-true", "mixed", "amp"})
_SWITCH_WORDS = frozenset({"amp", "fp16", "bf16", "half", "mixed", "autocast"})
_SETTING_WORDS = frozenset({"dtype", "precision"}) | _SWITCH_WORDS
_OFF_BY_DEVICE = ("no_cuda", "device")


def requested_flags(namespace: Mapping[str, Any]) -> dict[str, str]:
    """Settings of a script that ask for low precision: its globals, and one level into an argparse
    ``Namespace``, a ``SimpleNamespace`` or a dataclass instance among them.

    A ``torch.float16``/``torch.bfloat16`` value counts under any name; a string such as
    ``'float16'`` or ``'bf16-mixed'`` under a name with a word like dtype/precision/amp; ``True``
    under a switch name (``amp``, ``use_amp``, ``fp16``, ``mixed_precision``).

    >>> requested_flags({"dtype": "float16", "ptdtype": torch.bfloat16, "lr": 0.1, "device": "cpu",
    ...                  "args": argparse.Namespace(amp=True, fp16=False, sample_amplitude=True)})
    {'dtype': 'float16', 'ptdtype': 'bf16', 'args.amp': 'True'}
    """
    out: dict[str, str] = {}
    for name, value in namespace.items():
        if name.startswith("__"):
            continue
        if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
            inner: Mapping[str, Any] = vars(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
        else:
            inner = {name: value}
            name = ""
        for key, v in inner.items():
            try:
                flag = _flag(key, v)
            except Exception:  # a script's own object with odd __eq__/__bool__ must not cost the report
                continue
            if flag is not None:
                out[f"{name}.{key}" if name else key] = flag
    return out


def _flag(name: str, value: Any) -> str | None:
    words = set(name.lower().split("_"))
    if isinstance(value, torch.dtype):
        return dtype_name(value) if value in LOW_PRECISION_DTYPES else None
    if isinstance(value, bool):
        return "True" if value and words & _SWITCH_WORDS else None
    low = isinstance(value, str) and value.lower() in _LOW_VALUES
    return value if low and (words & _SETTING_WORDS or name.lower().endswith("dtype")) else None


def trained_in(ctx: Context) -> str | None:
    """What the observed forwards ran in: ``mixed`` (under autocast), ``fp16``/``bf16``
    (low-precision parameters without autocast), ``fp32``, or None when no model ran forward."""
    forwards = ctx.state.forwards
    if not forwards.total:
        return None
    if sum(forwards.autocast.values()):
        return "mixed"
    half = [d for d, n in forwards.half_params.most_common() if n]
    return dtype_name(half[0]) if half else "fp32"


def _low_dtypes(ctx: Context) -> list[str]:
    ran = {d for d, n in ctx.state.forwards.autocast.items() if n}
    ran |= {r.dtype for r in ctx.autocast.requests.values() if r.effective and r.entered}
    return sorted(dtype_name(d) for d in ran if d in LOW_PRECISION_DTYPES)


def _model_device(ctx: Context) -> str:
    last = ctx.state.models.last
    if last is not None:
        return last.device.type
    return min(ctx.state.forwards.devices, default="cpu")


def mixed_precision_record(ctx: Context, flags: Mapping[str, str], intended: str | None = None) -> dict[str, Any]:
    """The doctor JSON's ``mixed_precision``: what the script asked for and what actually ran."""
    scalers = [{"location": i.location, "built_as": i.built_as, "device": i.device, "enabled_arg": i.requested,
                "enabled": i.enabled, "off_reason": i.off_reason()} for i in ctx.state.scalers.infos]
    entered = ctx.autocast.requests
    autocast = [{"location": a.location, "device_type": a.device_type, "dtype": dtype_name(a.dtype),
                 "enabled_arg": a.requested, "enabled": a.effective,
                 "entered": entered[key].entered if key in entered else 0}
                for key, a in {**entered, **ctx.autocast.built}.items()]
    frameworks = [r.to_dict() for r in ctx.state.frameworks.requests]
    amp = (any(s["enabled_arg"] for s in scalers) or any(a["enabled_arg"] for a in autocast) or bool(flags)
           or ctx.state.scalers.ampkit_enabled or bool(frameworks))
    enabled = any(i.enabled for i in ctx.state.scalers.infos) or ctx.state.scalers.ampkit_enabled
    record: dict[str, Any] = {
        "requested": {"amp": amp, "scalers": scalers, "autocast": autocast, "flags": dict(flags),
                      "frameworks": frameworks, "precision": intended},
        "actual": {
            "forwards": ctx.state.forwards.total,
            "autocast_regions": sum(r.entered for r in entered.values() if r.effective),
            "autocast_dtypes": _low_dtypes(ctx),
            "scaler": "active" if enabled else "inactive" if scalers or ctx.state.scalers.ampkit_scaled else "none",
            "trained_in": trained_in(ctx),
        },
    }
    record["summary"] = fp32_note(record)
    return record


def fp32_note(record: Mapping[str, Any]) -> str | None:
    """The summary line's remark for a run that trained entirely in fp32 (None otherwise).

    >>> fp32_note({"requested": {"amp": False, "scalers": [], "autocast": [], "precision": None},
    ...            "actual": {"trained_in": "fp32"}})
    'the run trained entirely in fp32: the script never enables mixed precision, so nothing ran in low precision (`ampkit doctor --precision bf16 SCRIPT` shows what bf16 would do)'
    """
    if record["actual"]["trained_in"] != "fp32":
        return None
    requested = record["requested"]
    head = "the run trained entirely in fp32"
    if requested["amp"]:
        return f"{head}, although the script asks for mixed precision (see the findings)"
    if requested["scalers"] or requested["autocast"]:
        return f"{head}: the script's own switches turn mixed precision off (enabled=False)"
    if requested.get("precision"):
        return f"{head}; the checkup shows what --precision {requested['precision']} would do"
    return (f"{head}: the script never enables mixed precision, so nothing ran in low precision "
            "(`ampkit doctor --precision bf16 SCRIPT` shows what bf16 would do)")


def _autocast_off_without_cuda(ctx: Context) -> bool:
    """AUTOCAST_INACTIVE reports an autocast for "cuda" that torch disabled on this CUDA-less machine."""
    return not torch.cuda.is_available() and any(
        r.requested and not r.effective and r.device_type == "cuda" for r in ctx.autocast.requests.values())


def scaler_off_too(ctx: Context) -> str:
    """The clause AUTOCAST_INACTIVE adds when a GradScaler is off for the same reason (no CUDA): one
    finding for one cause, rather than a second MIXED_PRECISION_OFF for the scaler."""
    off = [i for i in ctx.state.scalers.infos if i.off_reason() == "no_cuda"]
    if not off:
        return ""
    return (f"; the {off[0].built_as} created at {off[0].location} is disabled for the same reason, so no loss is "
            "scaled either")


def report_mixed_precision_off(ctx: Context, flags: Mapping[str, str]) -> None:
    """MIXED_PRECISION_OFF into ``ctx.state.ledger``: scalers torch turned off, and a run without any
    autocast region although the script asks for mixed precision (run after AUTOCAST_INACTIVE)."""
    trained = trained_in(ctx)
    device = _model_device(ctx)
    if not _autocast_off_without_cuda(ctx):
        for info in ctx.state.scalers.infos:
            if info.off_reason() in _OFF_BY_DEVICE:
                _scaler_off(ctx, info, trained, device)
    if ctx.state.frameworks.requests:
        if trained == "fp32" and not ctx.state.ledger.has("AUTOCAST_INACTIVE"):
            _framework_off(ctx, device)
        elif trained == "mixed":
            _framework_other_dtype(ctx)
    elif trained == "fp32" and not ctx.state.ledger.has("AUTOCAST_INACTIVE"):
        _no_autocast(ctx, flags, device)


def _fp32_actual(forwards: int) -> str:
    return (f"none of the {forwards} forward pass(es) ran under autocast and the parameters are fp32: the model "
            "trained in fp32")


def _turn_on_scaler(device: str, autocast_there: bool) -> str:
    fix = (f"build it for the device the model runs on ({device}): `scaler = torch.amp.GradScaler(device_type)` "
           "with `device_type = 'cuda' if torch.cuda.is_available() else 'cpu'`")
    if not autocast_there:
        fix += (", and autocast the forward and the loss on that device: "
                "`with torch.autocast(device_type, dtype=torch.float16):`")
    if device == "cpu":
        fix += ("; on CPU, bf16 autocast needs no scaler: "
                "`torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)`")
    return fix


def _scaler_off(ctx: Context, info: ScalerInfo, trained: str | None, device: str) -> None:
    reason = info.off_reason()
    why = ("this machine has no CUDA device, so torch disabled the scaler when it was built (its one warning: "
           "'GradScaler is enabled, but CUDA is not available.  Disabling.')" if reason == "no_cuda"
           else f"torch does not scale losses on device {info.device!r}, so it disabled the scaler")
    severity: Severity = "warning"
    if trained == "bf16" or (trained == "mixed" and _low_dtypes(ctx) == ["bf16"]):
        severity = "info"  # bf16 needs no scaling: only a GPU would reveal the mistake (SCALER_WITH_BF16)
        actual = ("bf16, which needs no loss scaling: nothing is lost on this machine, but on a GPU this scaler "
                  "turns on and scales a bf16 loss")
        turn_on = "build it for fp16 only: `torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)`"
    elif trained in ("mixed", "fp16"):
        actual = "fp16 forwards without loss scaling: gradients below 6e-8 flush to zero in fp16"
        turn_on = _turn_on_scaler(device, autocast_there=trained == "mixed")
    else:
        actual = ("scaler.scale(loss) returned the loss unscaled and no step was checked for inf/NaN; "
                  + (_fp32_actual(ctx.state.forwards.total) if trained else "no model forward was observed"))
        turn_on = _turn_on_scaler(device, autocast_there=False)
    message, fix = mixed_precision_off(
        f"the {info.built_as} built at {info.location} (device {info.device!r}, enabled=True)", actual, why, turn_on)
    ctx.state.ledger.add(Finding(
        code="MIXED_PRECISION_OFF", severity=severity, message=message, fix=fix, location=info.location,
        evidence={"what": "scaler", "off_reason": reason, "built_as": info.built_as,
                  "scaler_device": info.device, "model_device": device, "trained_in": trained},
    ), key=("scaler", info.location))


def _no_autocast(ctx: Context, flags: Mapping[str, str], device: str) -> None:
    """No forward ran under autocast although a scaler, an autocast object or a setting asks for it."""
    watch = ctx.autocast
    built = {**watch.requests, **watch.built}
    infos = ctx.state.scalers.infos
    if not (any(a.requested for a in built.values()) or any(i.requested for i in infos) or flags):
        return  # every switch is off: fp32 on purpose (the summary line says so)
    unentered = [a for k, a in built.items() if a.requested and (k not in watch.requests or not
                                                                 watch.requests[k].entered)]
    switched_off = [a for a in built.values() if not a.requested]
    # A scaler built with enabled=False asks for nothing (torch.amp.GradScaler(enabled=use_fp16), off for bf16).
    asked = [f"a {i.built_as} built at {i.location}" for i in [i for i in infos if i.requested][:2]]
    asked += [f"torch.autocast({a.device_type!r}, dtype={dtype_name(a.dtype)}) built at {a.location}"
              for a in list(built.values())[:2]]
    if flags:
        asked.append("the setting(s) " + ", ".join(f"{k} = {v!r}" for k, v in list(flags.items())[:3]))
    if unentered:
        where = unentered[0].location
        why = f"the autocast built at {where} was never entered: no `with` block runs the forward inside it"
        turn_on = "run the forward and the loss inside it: `with ctx: loss = model(x, y)`"
    elif switched_off:
        where = switched_off[0].location
        why = (f"the autocast at {where} is built with enabled=False"
               + (" and so is the GradScaler" if any(i.off_reason() == "enabled_false" for i in infos) else "")
               + (f", although {next(iter(flags))} asks for mixed precision" if flags else ""))
        setting = f"`enabled={next(iter(flags))}`" if flags else "the switch that asks for it"
        turn_on = (f"derive enabled= from the setting itself ({setting}), not from a condition that is false on "
                   f"this machine (such as a device check): on {device}, fp16 autocast runs with "
                   f"torch.amp.GradScaler({device!r}), and bf16 autocast needs no scaler")
    else:
        where = infos[0].location if infos else None
        why = (f"no autocast was built for {device!r}, the device the model runs on: the script autocasts only "
               "on another device (as in `ctx = nullcontext() if device_type == 'cpu' else torch.autocast(...)`)")
        turn_on = (f"autocast on every device, the model's included: `ctx = torch.autocast(device_type="
                   f"{device!r}, dtype=...)` in place of the fallback"
                   + (" (on CPU, bf16 trains without a scaler; fp16 needs torch.amp.GradScaler('cpu'))"
                      if device == "cpu" else ""))
    message, fix = mixed_precision_off("the script (" + "; ".join(asked) + ")", _fp32_actual(ctx.state.forwards.total),
                                       why, turn_on)
    ctx.state.ledger.add(Finding(
        code="MIXED_PRECISION_OFF", severity="warning", message=message, fix=fix, location=where,
        evidence={"what": "autocast", "forwards": ctx.state.forwards.total, "autocast_regions": 0,
                  "flags": dict(flags), "model_device": device},
    ), key="no_autocast")


def _framework_off(ctx: Context, device: str) -> None:
    """A framework's settings object asks for mixed precision (``TrainingArguments(fp16=True)``), but no
    forward ran under autocast: the framework dropped it on this device."""
    req = ctx.state.frameworks.requests[0]
    if req.reason:
        reason, turn_on = req.reason, req.turn_on
    elif req.dtype == "fp16":
        reason, turn_on = accelerate_fp16_off(device, "TrainingArguments(bf16=True)")
    else:
        reason = f"the {req.framework} did not enable {req.dtype} autocast on {device}"
        turn_on = f"run on a device with {req.dtype} support (check `ampkit env`)"
    built = f" (built at {req.location})" if req.location else ""
    message, fix = mixed_precision_off(f"{req.setting}{built}", _fp32_actual(ctx.state.forwards.total), reason, turn_on)
    ctx.state.ledger.add(Finding(
        code="MIXED_PRECISION_OFF", severity="warning", message=message, fix=fix, location=req.location,
        evidence={"what": "framework", "setting": req.setting, "framework": req.framework,
                  "forwards": ctx.state.forwards.total, "autocast_regions": 0, "model_device": device,
                  "requested": req.dtype, "ran": "fp32"},
    ), key=("framework", req.setting))


def _framework_other_dtype(ctx: Context) -> None:
    """A framework setting asks for one low precision and the forwards autocast to the other: Lightning's
    ``Trainer(precision='16-mixed')`` on a CPU runs bf16."""
    ran = _low_dtypes(ctx)
    req = next((r for r in ctx.state.frameworks.requests if ran and r.dtype not in ran), None)
    if req is None:
        return
    regions = sum(r.entered for r in ctx.autocast.requests.values() if r.effective)
    reason = req.reason or f"the {req.framework} autocast to {'/'.join(ran)} instead"
    turn_on = req.turn_on or f"ask the {req.framework} for {'/'.join(ran)}, so that the code says what runs"
    built = f" (built at {req.location})" if req.location else ""
    actual = (f"the forwards ran under {'/'.join(ran)} autocast ({regions} region(s)): the model trained in "
              f"{'/'.join(ran)} mixed precision, with {'/'.join(ran)}'s precision and range instead of {req.dtype}'s")
    message, fix = mixed_precision_off(f"{req.setting}{built}", actual, reason, turn_on, dtype=req.dtype)
    ctx.state.ledger.add(Finding(
        code="MIXED_PRECISION_OFF", severity="warning", message=message, fix=fix, location=req.location,
        evidence={"what": "framework", "setting": req.setting, "framework": req.framework,
                  "forwards": ctx.state.forwards.total, "autocast_regions": regions, "requested": req.dtype,
                  "ran": "/".join(ran)},
    ), key=("framework", req.setting))
