"""``FileContext``: one parsed file plus the questions rules ask about it.

Everything is computed lazily and at most once per file: the flow pass (scopes, calls, bindings,
imports) runs only when a rule that passed its substring screen asks for it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from ampkit.lint.astutil import call_arg, const_bool, const_str, expr_key, last_name, source_lines
from ampkit.lint.flow import Flow, Scope, Site, build_flow

__all__ = ["CAST_METHODS", "LOW", "TORCH_DTYPE_NAMES", "Autocast", "FileContext", "scaled_receiver"]

DTYPES = {
    "torch.float16": "fp16", "torch.half": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float32": "fp32", "torch.float": "fp32",
    "torch.float64": "fp64", "torch.double": "fp64",
}
LOW = ("fp16", "bf16")
TORCH_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16"}
"""The torch spelling of a low-precision dtype, for messages about a tensor's dtype."""
CAST_METHODS = {"half": "fp16", "bfloat16": "bf16"}
"""Tensor/module methods that cast to a low-precision dtype when called without arguments."""

_TEST_FRAMEWORKS = ("pytest", "unittest", "torch.testing")

AUTOCAST = frozenset({"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"})
LEGACY_AUTOCAST = {
    "torch.cuda.amp.autocast": "cuda", "torch.cuda.amp.autocast_mode.autocast": "cuda",
    "torch.cpu.amp.autocast": "cpu", "torch.cpu.amp.autocast_mode.autocast": "cpu",
}
# torch.get_autocast_dtype(device) for the devices whose default is stable across releases.
DEFAULT_AUTOCAST_DTYPE = {"cuda": "fp16", "cpu": "bf16", "mps": "fp16", "xpu": "bf16", "hpu": "bf16"}

SCALER_CLASSES = frozenset({"GradScaler", "ShardedGradScaler"})
OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
    "ASGD", "LBFGS", "SparseAdam", "Adafactor", "Muon",
})


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) \
        and any(const_str(side) == "__main__" for side in sides)


@dataclass(frozen=True, slots=True)
class Autocast:
    """What an autocast call site says, as far as the source tells."""

    call: ast.Call
    device: str | None
    """The device type when it is a literal (``cuda``, ``cpu``, ...), else None."""
    dtype: str | None
    """``fp16`` / ``bf16`` / ``fp32``, or None when it cannot be decided."""
    enabled: bool | None
    """False only for a literal ``enabled=False``; None when decided at run time."""
    may_be_fp16: bool = False
    """The dtype is not given and the device may be CUDA (``device.type``, ``str(device)``, a name
    bound to ``"cuda"`` on some path): the region runs in fp16 on a GPU."""


class FileContext:
    """A parsed source file and lazily computed facts about it."""

    def __init__(self, path: str, source: bytes, tree: ast.Module) -> None:
        self.path = path
        self.source = source
        self.tree = tree
        self.memo: dict[str, dict[int, object]] = {}
        """Per-file caches of the modules above this one (``steps``: the paths of each scope)."""

    # -- structure -----------------------------------------------------------------------------
    @cached_property
    def flow(self) -> Flow:
        return build_flow(self.tree)

    @property
    def scopes(self) -> list[Scope]:
        return self.flow.scopes

    def calls(self) -> Iterator[tuple[Scope, Site]]:
        """Every call in the file with its scope, scope by scope in source order."""
        for scope in self.flow.scopes:
            for site in scope.calls:
                yield scope, site

    @cached_property
    def is_test_file(self) -> bool:
        """The file is a test: it imports a test framework (pytest, unittest, torch.testing), or it
        is a script that checks itself, with an ``assert`` in its ``if __name__ == "__main__":``
        block (accelerate's "fp8 integration matches raw torchao" scripts).  A test runs eager,
        backward inside autocast or a device fixed by its parameters on purpose, and a wrong answer
        fails the test itself, so the rules about training code leave it alone."""
        if any(target is not None and target.startswith(_TEST_FRAMEWORKS) for target in self.flow.imports.values()):
            return True
        return any(isinstance(stmt, ast.If) and _is_main_guard(stmt.test)
                   and any(isinstance(node, ast.Assert) for node in ast.walk(stmt)) for stmt in self.tree.body)

    @cached_property
    def parents(self) -> dict[int, ast.AST]:
        """``id(node)`` -> parent node, for the few rules that look upwards (a full walk: lazy)."""
        return {id(child): node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}

    @cached_property
    def lines(self) -> list[bytes]:
        return source_lines(self.source)

    def position(self, node: ast.AST) -> tuple[int, int]:
        """1-based line and 1-based *character* column of ``node`` (ast gives UTF-8 byte offsets)."""
        line = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0)
        if 0 < line <= len(self.lines):
            raw = self.lines[line - 1]
            if not raw.isascii():
                col = len(raw[:col].decode("utf-8", "replace"))
        return line, col + 1

    def segment(self, node: ast.AST) -> str:
        """The source text of a one-line node (``ast.unparse`` for longer ones)."""
        line, end = getattr(node, "lineno", 0), getattr(node, "end_lineno", None)
        if line == end and 0 < line <= len(self.lines):
            raw = self.lines[line - 1][node.col_offset:node.end_col_offset]  # type: ignore[attr-defined]
            return raw.decode("utf-8", "replace")
        return ast.unparse(node)

    # -- names ---------------------------------------------------------------------------------
    def qualname(self, node: ast.AST) -> str | None:
        """Fully qualified dotted name of ``node`` through the file's imports, else None.

        ``F.softmax`` after ``import torch.nn.functional as F`` is ``torch.nn.functional.softmax``;
        a bare ``torch`` that is never imported (a snippet) still counts as ``torch``.
        """
        key = expr_key(node)
        if key is None:
            return None
        head, dot, rest = key.partition(".")
        base = self.flow.imports.get(head)
        if base is None:
            if head != "torch" or head in self.flow.imports:
                return None
            base = "torch"
        return base + dot + rest

    def lookup(self, key: str, scope: Scope) -> list[ast.expr | None] | None:
        """Every value ``key`` is bound to where ``scope`` sees it; None when it is bound nowhere.

        ``self.x`` is looked up across all methods of the class; other names through the
        enclosing function scopes up to the module (class bodies are skipped, as in Python).
        """
        if key.startswith("self.") or key.startswith("cls."):
            if scope.cls is None:
                return scope.bindings.get(key)
            found: list[ast.expr | None] = []
            for other in self.scopes:
                if other.cls is scope.cls:
                    found.extend(other.bindings.get(key, ()))
            return found or None
        current: Scope | None = scope
        while current is not None:
            if key in current.bindings and (current is scope or not isinstance(current.node, ast.ClassDef)):
                return current.bindings[key]
            current = current.parent
        return None

    def value_of(self, node: ast.AST, scope: Scope) -> ast.expr | None:
        """The single value a name/attribute chain is bound to, else None (unknown or rebound)."""
        key = expr_key(node)
        if key is None:
            return None
        values = self.lookup(key, scope)
        if values is None or len(values) != 1:
            return None
        return values[0]

    # -- dtypes and autocast -------------------------------------------------------------------
    def dtype_of(self, node: ast.AST | None, scope: Scope, depth: int = 0) -> str | None:
        """``fp16`` / ``bf16`` / ``fp32`` / ``fp64`` for a dtype expression (following one binding)."""
        if node is None or depth > 4:
            return None
        name = self.qualname(node)
        if name in DTYPES:
            return DTYPES[name]
        if isinstance(node, (ast.Name, ast.Attribute)):
            return self.dtype_of(self.value_of(node, scope), scope, depth + 1)
        return None

    def autocast_info(self, call: ast.Call, scope: Scope) -> Autocast | None:
        """Describe ``call`` when it opens an autocast region, else None."""
        name = self.qualname(call.func)
        if name in AUTOCAST:
            device = const_str(call_arg(call, 0, "device_type"))
            dtype_node = call_arg(call, 1, "dtype")
            enabled_node = call_arg(call, 2, "enabled")
        elif name in LEGACY_AUTOCAST:
            device = LEGACY_AUTOCAST[name]
            dtype_node = call_arg(call, 1, "dtype")
            enabled_node = call_arg(call, 0, "enabled")
        elif last_name(call.func) == "autocast":
            # accelerator.autocast(), a project's own wrapper: an autocast region of unknown dtype.
            return Autocast(call, None, None, const_bool(call_arg(call, None, "enabled")))
        else:
            return None
        devices = {device} if device else set()
        if name in AUTOCAST and device is None:
            devices = self.devices_of(call_arg(call, 0, "device_type"), scope)
            device = next(iter(devices)) if len(devices) == 1 and "?" not in devices else None
        if dtype_node is None:
            dtype = DEFAULT_AUTOCAST_DTYPE.get(device) if device else None
        else:
            dtype = self.dtype_of(dtype_node, scope)
        enabled = True if enabled_node is None else const_bool(enabled_node)
        may_be_fp16 = dtype_node is None and bool(devices & {"cuda", "?"})
        return Autocast(call, device, dtype, enabled, may_be_fp16 or dtype == "fp16")

    def devices_of(self, node: ast.AST | None, scope: Scope, depth: int = 0) -> set[str]:
        """The device types ``node`` may name: literals, names bound to them (on any path), and
        ``"?"`` for a device read at run time (``device.type``, ``str(device)``, ``x.device.type``),
        which may be CUDA.  Empty when nothing can be said (a parameter, a call)."""
        if node is None or depth > 3:
            return set()
        text = const_str(node)
        if text is not None:
            return {text.partition(":")[0]}
        if isinstance(node, ast.IfExp):
            return self.devices_of(node.body, scope, depth + 1) | self.devices_of(node.orelse, scope, depth + 1)
        if isinstance(node, ast.Attribute) and node.attr == "type":
            bound = self.value_of(node.value, scope)
            if isinstance(bound, ast.Call) and last_name(bound.func) == "device":
                found = self.devices_of(call_arg(bound, 0, "type"), scope, depth + 1)
                return found or {"?"}
            return {"?"}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" \
                and len(node.args) == 1:
            return {"?"}
        if isinstance(node, ast.Name):
            values = self.lookup(node.id, scope) or []
            if values and all(v is not None for v in values):
                found = set()
                for value in values:
                    one = self.devices_of(value, scope, depth + 1)
                    if not one:
                        return set()
                    found |= one
                return found
        return set()

    def autocast_items(self, scope: Scope) -> Iterator[tuple[Site, Autocast]]:
        """Each autocast call a ``with`` statement of ``scope`` enters, ``enabled=False`` ones included."""
        for site in scope.withs:
            for item in site.node.items:  # type: ignore[attr-defined]
                call = self.autocast_object(item.context_expr, scope)
                if call is not None:
                    info = self.autocast_info(call, scope)
                    if info is not None:
                        yield site, info

    def autocast_object(self, expr: ast.expr, scope: Scope) -> ast.Call | None:
        """The call a ``with`` item enters: the item itself, or the one autocast object a name or
        ``self.`` attribute is bound to (``self.ctx = torch.autocast(...)`` in ``__init__``,
        ``with self.ctx:`` in another method; ``nullcontext() if cpu else torch.autocast(...)``)."""
        if isinstance(expr, ast.Call):
            return expr
        bound = self.value_of(expr, scope) if isinstance(expr, (ast.Name, ast.Attribute)) else None
        choices = [bound.body, bound.orelse] if isinstance(bound, ast.IfExp) else [bound]
        found = [c for c in choices if isinstance(c, ast.Call) and last_name(c.func) == "autocast"]
        return found[0] if len(found) == 1 else None

    def autocast_withs(self, scope: Scope) -> list[tuple[Site, Autocast]]:
        """The ``with`` statements of ``scope`` that open an autocast region (not ``enabled=False``)."""
        return [(site, info) for site, info in self.autocast_items(scope) if info.enabled is not False]

    @cached_property
    def uses_autocast(self) -> bool:
        """True when the file opens an autocast region anywhere (``autocast(...)`` is called)."""
        if b"autocast" not in self.source:
            return False
        return any(last_name(site.node.func) == "autocast"  # type: ignore[attr-defined]
                   for scope in self.scopes for site in scope.calls)

    @cached_property
    def imports_torch(self) -> bool:
        """True when the file imports torch (its tensors may be torch tensors, not numpy arrays)."""
        return any(target is not None and (target == "torch" or target.startswith("torch."))
                   for target in self.flow.imports.values())

    @cached_property
    def code_source(self) -> bytes:
        """The source without its comments and docstrings: what the program says, not what its prose
        says.  A docstring that mentions a GradScaler the script lacks must not count as one.
        Costs one tokenize pass over the file, only for the rules that ask."""
        prose = {(node.body[0].value.lineno, node.body[0].value.col_offset)
                 for node in ast.walk(self.tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.body and isinstance(node.body[0], ast.Expr)
                 and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
        kept = []
        try:
            for tok in tokenize.tokenize(io.BytesIO(self.source).readline):
                if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in prose):
                    continue
                kept.append(tok.string)
        except (tokenize.TokenError, SyntaxError):
            return self.source  # the tree parsed, so this is rare; the whole text is the safe side
        return " ".join(kept).encode("utf-8", "surrogatepass")

    @cached_property
    def mentions_low_precision(self) -> bool:
        """True when the file itself speaks of fp16/bf16 (autocast, half(), a low dtype, a scaler)."""
        source = self.source
        return any(token in source for token in (
            b"autocast", b"float16", b"bfloat16", b".half(", b"GradScaler", b"fp16", b"bf16"))

    # -- training objects ----------------------------------------------------------------------
    def scaler_call(self, value: ast.AST | None) -> ast.Call | None:
        """``value`` when it constructs a GradScaler (torch.amp / cuda / cpu / sharded), else None."""
        if isinstance(value, ast.Call) and last_name(value.func) in SCALER_CLASSES:
            name = self.qualname(value.func)
            if name is None or name.startswith("torch."):
                return value
        return None

    def scaler_construction(self, key: str, scope: Scope) -> ast.Call | None:
        """The GradScaler construction bound to ``key`` as seen from ``scope`` (one binding only)."""
        values = self.lookup(key, scope)
        if not values:
            return None
        calls = [self.scaler_call(v) for v in values if v is not None]
        found = [c for c in calls if c is not None]
        return found[0] if len(found) == 1 else None

    @staticmethod
    def scaler_enabled(call: ast.Call) -> bool | None:
        """Literal ``enabled=`` of a GradScaler construction (True when absent, None when dynamic)."""
        # Only the keyword form is read: ``enabled`` is the 5th/6th positional argument (legacy /
        # torch.amp signatures) and nobody passes it positionally.
        node = call_arg(call, None, "enabled")
        return True if node is None else const_bool(node)

    @cached_property
    def scaler_usage_keys(self) -> frozenset[str]:
        """Receivers used like a scaler anywhere in the file: ``S.scale(x).backward()``, ``S.unscale_(o)``."""
        keys = set()
        for scope in self.scopes:
            for site in scope.calls:
                call = site.node
                func = call.func  # type: ignore[attr-defined]
                if not isinstance(func, ast.Attribute):
                    continue
                if func.attr == "unscale_":
                    key = expr_key(func.value)
                    if key:
                        keys.add(key)
                elif func.attr == "backward":
                    key = scaled_receiver(func.value)
                    if key:
                        keys.add(key)
        return frozenset(keys)

    def is_scaler(self, key: str | None, scope: Scope) -> bool:
        """True when ``key`` names an enabled GradScaler (constructed here or used like one)."""
        if key is None:
            return False
        construction = self.scaler_construction(key, scope)
        if construction is not None:
            return self.scaler_enabled(construction) is not False
        return key in self.scaler_usage_keys

    def bound_calls(self, key: str, scope: Scope) -> Iterator[ast.Call]:
        """The calls among the values ``key`` is bound to where ``scope`` sees it."""
        for value in self.lookup(key, scope) or ():
            if isinstance(value, ast.Call):
                yield value

    def is_optimizer_call(self, call: ast.Call) -> bool:
        """True when ``call`` constructs a torch optimizer (``torch.optim.*`` or a known class name)."""
        name = self.qualname(call.func) or ""
        return (name.startswith("torch.optim.") and ".lr_scheduler." not in name) or \
            last_name(call.func) in OPTIMIZERS

    def is_optimizer(self, key: str | None, scope: Scope) -> bool:
        """True when ``key`` is bound to a torch optimizer, or is named like one."""
        if key is None:
            return False
        if any(self.is_optimizer_call(call) for call in self.bound_calls(key, scope)):
            return True
        last = key.rpartition(".")[2].lower()
        return last in ("opt", "optim", "optimizer") or "optimizer" in last or last.endswith("_opt")

    def is_scheduler(self, key: str | None, scope: Scope) -> bool:
        """True when ``key`` is bound to a learning-rate scheduler, or is named like one."""
        if key is None:
            return False
        for call in self.bound_calls(key, scope):
            name = self.qualname(call.func) or ""
            callee = last_name(call.func) or ""
            if ".lr_scheduler." in name or "schedule" in callee.lower() or callee.endswith("LR"):
                return True
        return "sched" in key.rpartition(".")[2].lower()


def scaled_receiver(node: ast.AST) -> str | None:
    """``S`` for an expression ``S.scale(...)``; None for anything else."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "scale" and node.args):
        return expr_key(node.func.value)
    return None
