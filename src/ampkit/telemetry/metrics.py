"""On-device step metrics: a preallocated buffer with one row per optimizer step.

Every value of a step is produced by tensor ops on the engine's device and written into row
``r`` of a ``(flush_every, len(COLUMNS))`` buffer; the host reads the buffer once per flush
(``MetricBuffer.read``: one device-to-host copy, the only sync).  On an accelerator nothing here
calls ``.item()``, ``bool(tensor)`` or ``.cpu()``; on CPU, where such a read waits for nothing
(``reads_are_free``), ``GradCounter`` reads one scalar per step to skip work.

Gradient element counts (zeros, non-finite values) are exact counts, summed from float
masks (``sum`` of a float32 mask is several times faster than ``count_nonzero`` on CPU):

* ``eq(g, 0)`` marks the zeros (a NaN is not zero);
* ``g * 0`` is 0 where ``g`` is finite and NaN where it is inf/NaN, and NaN is the only value
  not equal to itself, so ``ne(g * 0, g * 0)`` marks the non-finite elements.

Large gradients are read in place, range by range; small ones are first packed into a
reused flat workspace (``torch.cat(..., out=)``) so that a model with many small parameters
(biases, norms) still costs a handful of kernels.  On an accelerator each chunk is six kernels
(four without the zero count), and a chunk is 8 Mi elements (a float32 mask sums exactly below
2**24), so a step is a few kernels.  On CPU a chunk is 256 Ki elements, small enough for the mask
and the workspace to stay in the L2 cache, so the gradients are read from memory once; each
chunk is first summed, and only when a sum is inf or NaN are its non-finite elements counted,
which saves three of the six kernels on every ordinary step.  ``torch._foreach_norm(g, 0)`` would
count non-zeros in one call but takes a generic slow path (about 150 ms for 3 M elements on a
CPU), and ``isfinite`` is not vectorised on CPU.

>>> import torch
>>> counter = GradCounter(torch.device("cpu"))
>>> zeros, nonfinite = counter.count([torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([-0.0, float("inf")])])
>>> int(zeros), int(nonfinite)
(2, 2)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ampkit._util.grads import grad_values

__all__ = ["COL", "COLUMNS", "ROW_BATCH", "GradCounter", "MetricBuffer", "ModuleAbsmax", "reads_are_free"]

COLUMNS = (
    "loss_sum",         # sum of the losses passed to mp.backward since the previous boundary (inf/NaN: one was)
    "input_bounds",     # sum of the min and max of each watched floating input (inf/NaN: an input held inf/NaN)
    "found_inf",        # > 0: the step was skipped
    "grad_norm",        # unscaled global L2 norm before clipping (NaN: no gradients)
    "clip_coef",        # min(1, max_norm / (norm + 1e-6)), 1 without clipping
    "nonfinite_grads",  # inf/NaN gradient elements
    "zero_grads",       # gradient elements == 0
    "scale",            # loss scale this step's gradients were produced with
    "next_scale",       # loss scale after the update (a backoff shows as next_scale < scale)
    "lr",               # learning rate when the optimizer holds it as a tensor (else NaN)
)
COL = {name: i for i, name in enumerate(COLUMNS)}

# Flat workspace per dtype: cache-sized on CPU, large on accelerators (fewer kernels).
_CPU_WORKSPACE = 1 << 18
_DEVICE_WORKSPACE = 1 << 23


def buffer_dtype(device: torch.device) -> torch.dtype:
    """float64 keeps integer counts exact to 2**53; MPS has no float64, so float32 there."""
    return torch.float32 if device.type == "mps" else torch.float64


class GradCounter:
    """Counts zero and non-finite gradient elements without a host sync.

    Returns two float device scalars ``(zeros, nonfinite)`` holding exact integers.  The
    workspace (one per gradient dtype, so nothing is cast) holds at most
    ``workspace_elements`` elements; the float32 mask beside it is shared.
    """

    def __init__(self, device: torch.device, *, workspace_elements: int | None = None) -> None:
        self.device = device
        if workspace_elements is None:
            workspace_elements = _CPU_WORKSPACE if device.type == "cpu" else _DEVICE_WORKSPACE
        if not 1 <= workspace_elements <= 1 << 24:
            raise ValueError(f"workspace_elements={workspace_elements}: must be in [1, 2**24] so an fp32 "
                             "mask sums exactly")
        self.workspace_elements = workspace_elements
        self._mask = torch.empty(0, dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self.reads_free = reads_are_free(device)
        self._workspaces: dict[torch.dtype, torch.Tensor] = {}
        self._plans: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}

    def count(self, grads: Sequence[torch.Tensor], *, zeros: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(zeros, nonfinite)`` element counts; ``zeros=False`` skips the zero count (NaN: not measured)."""
        if not grads:
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            return zero, zero
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        apart: list[torch.Tensor] = []
        for g in grads:
            if g.layout is not torch.strided or g.is_complex():  # sparse gradients have no memory to pack
                apart.append(g)
            else:
                by_dtype.setdefault(g.dtype, []).append(g)
        counts = [self._count_packed(dtype, group, zeros) for dtype, group in by_dtype.items()]
        # Per-chunk counts are exact in float32 (< 2**24); the total is summed in float64 where it exists.
        acc = buffer_dtype(self.device)
        totals = torch.cat(counts).to(acc).sum(0) if counts else torch.zeros(2, dtype=acc, device=self.device)
        for g in apart:
            totals = totals + _counts_apart(g, acc)
        return (totals[0] if zeros else totals[0] * math.nan), totals[1]

    def _count_packed(self, dtype: torch.dtype, grads: list[torch.Tensor], zeros: bool) -> torch.Tensor:
        """``(chunks, 2)`` float32 counts ``[zeros, non-finite]`` of ``grads`` (all of ``dtype``); the zeros
        column is 0 when ``zeros`` is False."""
        if self.reads_free:
            found, sums = [], []
            for src, _, mask in self._chunks(dtype, grads):
                if zeros:
                    found.append(torch.eq(src, 0, out=mask).sum())
                sums.append(src.sum(dtype=torch.float32))
            # A sum is finite only when every element is (an inf or NaN makes it inf or NaN; a finite
            # overflow only sends the step down the exact path below).  Reading it is no sync on CPU,
            # where every kernel has run when its call returns, and it replaces the three kernels per
            # chunk that count the non-finite elements, on every step that has none.
            if torch.stack(sums).sum().isfinite().item():
                nonfinite = torch.zeros(len(sums), dtype=torch.float32, device=self.device)
                return torch.stack([torch.stack(found) if zeros else nonfinite, nonfinite], dim=1)
        out = []
        for src, work, mask in self._chunks(dtype, grads):
            zero_count = torch.eq(src, 0, out=mask).sum() if zeros else self._zero
            torch.mul(src, 0.0, out=work)  # finite -> 0, inf/NaN -> NaN
            out.append(torch.stack([zero_count, torch.ne(work, work, out=mask).sum()]))
        return torch.stack(out)

    def _chunks(self, dtype: torch.dtype,
                grads: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(source, workspace, mask)`` per chunk of the plan for these gradient sizes; a source packed
        from small tensors lives in the workspace."""
        numels = tuple(g.numel() for g in grads)
        plan = self._plans.get(numels)
        if plan is None:
            plan = self._plans[numels] = _plan_chunks(numels, self.workspace_elements)
        total = min(sum(numels), self.workspace_elements)
        ws = self._workspaces.get(dtype)
        if ws is None or ws.numel() < total:
            ws = self._workspaces[dtype] = torch.empty(total, dtype=dtype, device=self.device)
        if self._mask.numel() < total:
            self._mask = torch.empty(total, dtype=torch.float32, device=self.device)
        flats = [g.reshape(-1) for g in grads]
        for chunk in plan:
            n = sum(b - a for _, a, b in chunk)
            work, mask = ws[:n], self._mask[:n]
            if len(chunk) == 1:  # a range of one tensor: read in place, no copy
                i, a, b = chunk[0]
                src = flats[i][a:b]
            else:  # small tensors: one copy into the workspace, then a few kernels for all of them
                src = torch.cat([flats[i][a:b] for i, a, b in chunk], out=work)
            yield src, work, mask


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a scalar of ``device`` on the host costs nothing: on CPU every kernel has run
    when its call returns, so there is nothing to wait for.  Everywhere else it is a sync."""
    return device.type == "cpu"


def _counts_apart(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(zeros, non-finite) of a sparse or complex gradient, counted apart from the packed chunks.

    Sparse (any layout): its implicit zeros count as zeros; a COO gradient is coalesced first (a sort
    and a copy of the values) so duplicate indices are summed, as the optimizer will.  Complex: an
    element is zero when both parts are and non-finite when either is (the float32 mask of the packed
    path would cast the complex comparison, with a warning).  Both allocate their masks each step,
    for these gradients only.
    """
    values = grad_values(g)
    nonzero = torch.count_nonzero(values).to(dtype)
    nonfinite = torch.count_nonzero(~torch.isfinite(values)).to(dtype)
    return torch.stack([g.numel() - nonzero, nonfinite])


def _plan_chunks(numels: Sequence[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """Chunks of at most ``cap`` elements, as ``(tensor, start, end)`` ranges.

    A tensor of at least ``cap // 4`` elements gets chunks of its own (read in place); the
    smaller ones are packed together (one copy, then one set of kernels for all of them).

    >>> _plan_chunks([3, 20, 1, 2], 16)
    [[(1, 0, 16)], [(1, 16, 20)], [(0, 0, 3), (2, 0, 1), (3, 0, 2)]]
    """
    chunks: list[list[tuple[int, int, int]]] = []
    for i, n in enumerate(numels):
        if n >= max(cap // 4, 1):
            chunks.extend([(i, a, min(a + cap, n))] for a in range(0, n, cap))
    packed: list[list[tuple[int, int, int]]] = [[]]
    room = cap
    for i, n in enumerate(numels):
        if n >= max(cap // 4, 1):
            continue
        start = 0
        while start < n:
            if room == 0:
                packed.append([])
                room = cap
            take = min(room, n - start)
            packed[-1].append((i, start, start + take))
            start += take
            room -= take
    chunks.extend(packed)
    return [c for c in chunks if c]


class ModuleAbsmax:
    """Per-module gradient absmax (max |g| over the parameters each module owns directly).

    Parameters are named through the engine's prepared models (``named_parameters``); a
    parameter that no prepared model owns is reported under ``"(unnamed)"``.  A parameter
    held by the root module is reported under ``"(root)"``.  The per-parameter maxima are
    one ``_foreach_max(_foreach_abs(...))``; the scatter into modules is one
    ``scatter_reduce_``.  NaN propagates, so a module with a NaN gradient reports NaN.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] = []
        self._module_of: dict[int, int] = {}
        self._index_cache: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    def rebuild(self, models: Sequence[nn.Module]) -> None:
        names: dict[str, int] = {}
        module_of: dict[int, int] = {}
        for m_i, model in enumerate(models):
            prefix = f"model{m_i}." if len(models) > 1 else ""
            for pname, p in model.named_parameters():
                owner = pname.rpartition(".")[0] or "(root)"
                module_of.setdefault(id(p), names.setdefault(prefix + owner, len(names)))
        self.names, self._module_of = list(names), module_of
        self._index_cache.clear()

    def compute(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                models: Sequence[nn.Module]) -> tuple[torch.Tensor, list[int]]:
        """Per-module absmax over ``len(self.names)`` modules (-inf where absent) and the present module ids."""
        key = tuple(id(p) for p in params)
        cached = self._index_cache.get(key)
        if cached is None:
            if any(id(p) not in self._module_of for p in params):
                self.rebuild(models)
                if any(id(p) not in self._module_of for p in params):
                    self.names.append("(unnamed)")
                    unnamed = len(self.names) - 1
                    for p in params:
                        self._module_of.setdefault(id(p), unnamed)
            ids = [self._module_of[id(p)] for p in params]
            # A host-to-device copy, once per distinct parameter set (cached afterwards).
            cached = (torch.tensor(ids, dtype=torch.int64, device=self.device), sorted(set(ids)))
            self._index_cache[key] = cached
        index, present = cached
        if all(g.layout is torch.strided for g in grads):
            per_param = torch.stack(torch._foreach_max(torch._foreach_abs(list(grads)))).float()
        else:  # a sparse gradient: the max of its (coalesced) values, 0 when it has none (all implicit zeros)
            per_param = torch.stack([_absmax(grad_values(g)) for g in grads])
        out = torch.full((len(self.names),), -math.inf, dtype=torch.float32, device=self.device)
        return out.scatter_reduce_(0, index, per_param, "amax", include_self=False), present


def _absmax(values: torch.Tensor) -> torch.Tensor:
    if not values.numel():
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return values.detach().abs().max().float()


ROW_BATCH = 64
"""Rows ``MetricBuffer.add_row`` queues before writing them into the buffer with one stack."""


class MetricBuffer:
    """``rows`` x ``len(COLUMNS)`` device buffer plus the sampled tables (``"modules"``: per-module absmax,
    ``"fp8"``: fp8 operand statistics), one row per sampled step.

    A step's row arrives as its values, 0-dim device tensors (``add_row``), and is queued: every
    ``ROW_BATCH`` rows, and before a read, the queue is written with one ``torch.stack`` and one copy
    per run of float32 rows, so a step launches no kernel for its row (a row holding another dtype, a
    float64 count, is stacked on its own when it arrives).  The queue holds the tensors themselves, so a caller
    passes only values that nothing writes afterwards (a copy of those that change in place).
    """

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.dtype = buffer_dtype(device)
        self.rows = rows
        self.data = torch.full((rows, len(COLUMNS)), math.nan, dtype=self.dtype, device=device)
        self.tables: dict[str, torch.Tensor] = {}
        self._queued: list[list[torch.Tensor] | torch.Tensor] = []
        self._written = 0

    def add_row(self, values: list[torch.Tensor]) -> None:
        """Queue the next step row (``COLUMNS`` order, 0-dim tensors on the buffer's device)."""
        if all(v.dtype is torch.float32 for v in values):
            self._queued.append(values)
        else:  # stacked now, promoted: one kernel (steps with float64 counts or sums), not a slow batch later
            self._queued.append(torch.stack(values))
        if len(self._queued) >= ROW_BATCH:
            self._write_queued()

    def _write_queued(self) -> None:
        """Write the queued rows: each run of float32 rows with one stack and one copy (a stack of mixed
        dtypes converts value by value, several times slower), each row stacked at ``add_row`` with a copy."""
        queued, self._queued = self._queued, []
        run: list[torch.Tensor] = []
        start = row = self._written
        for entry in queued:
            if isinstance(entry, list):
                run.extend(entry)
            else:
                self._write_run(start, run)
                run = []
                self.data[row].copy_(entry)
                start = row + 1
            row += 1
        self._write_run(start, run)
        self._written = row

    def _write_run(self, start: int, run: list[torch.Tensor]) -> None:
        if run:
            k = len(run) // len(COLUMNS)
            self.data[start:start + k].copy_(torch.stack(run).view(k, len(COLUMNS)))

    def row(self, table: str, k: int, width: int) -> torch.Tensor:
        """Row ``k`` of ``table``, grown (on the device, no sync) to fit ``width`` values."""
        old = self.tables.get(table, torch.empty((0, 0), dtype=self.dtype, device=self.device))
        rows, cols = old.shape
        if k >= rows or width > cols:
            grown = torch.full((max(rows, k + 1, 4), max(cols, width)), math.nan, dtype=self.dtype,
                               device=self.device)
            grown[:rows, :cols] = old
            self.tables[table] = old = grown
        return old[k]

    def module_row(self, k: int, width: int) -> torch.Tensor:
        """Row ``k`` of the module absmax table, grown to fit ``width`` modules."""
        return self.row("modules", k, width)

    def read(self, n: int, sampled: dict[str, int]) -> tuple[list[list[float]], dict[str, list[list[float]]]]:
        """Copy the first ``n`` step rows and the first ``sampled[table]`` rows of each table to the host:
        the one sync per flush.  The rows start again at 0 afterwards."""
        self._write_queued()
        self._written = 0
        used = [(name, k, self.tables[name]) for name, k in sampled.items() if k and name in self.tables]
        parts = [self.data[:n].reshape(-1), *(t[:k].reshape(-1) for _, k, t in used)]
        flat = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
        cols = len(COLUMNS)
        steps = [flat[i * cols:(i + 1) * cols] for i in range(n)]
        base, tables = n * cols, {}
        for name, k, t in used:
            width = t.shape[1]
            tables[name] = [flat[base + j * width: base + (j + 1) * width] for j in range(k)]
            base += k * width
        return steps, tables
