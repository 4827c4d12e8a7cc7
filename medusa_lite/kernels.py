"""Cheaper multi-token verification on CPU: the target's linear layers through prepacked MKL GEMM.

On a CPU, a verify forward of a few tree tokens is a set of small-M GEMMs (M = tree tokens). MKL's
ordinary fp32 GEMM pays a packing step for M >= 2 that a one-token GEMV does not (on an AVX2-only CPU
two tokens cost ~1.6x one through the 49152 x 576 ``lm_head``), so the forward costs far more than
reading the weights once. With the weights packed once (``torch.ops.mkl._mkl_reorder_linear_weight``),
MKL's packed GEMM skips that step. A packed copy serves exactly the row count it was packed for, so the weights
are packed for a few counts (:data:`PACKED_ROWS`) and an input of m rows is zero-padded to the smallest count
>= m (the padding rows' outputs are dropped): on an AVX2 CPU a 2-token verify forward costs ~1.25x one token
through the 4-row pack, ~1.4x through an 8-row one and ~1.9x through the stock GEMM.

:class:`PackedLinears` is a context manager: while it is active (verify forwards only, and only for the tree
sizes where the probe measured it faster), each of the target's fp32 ``nn.Linear`` modules takes the packed path (its
``forward`` is shadowed by an instance attribute, restored on exit); everything else, and the whole model outside
the context, is untouched. No modeling code is forked. (A ``TorchFunctionMode`` did the same by intercepting every
torch call of the forward, ~2,600 per forward of the default model: ~10 ms of Python per verify step.) Each packed copy costs as much memory as the linear weights, so only as many row
counts are packed as fit in a quarter of the memory available (:func:`packed_rows`). Results differ
from ``F.linear`` only in summation order (as any two GEMM kernels do), so greedy output stays the
target's own up to floating-point ties, like every tree forward.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import torch
from torch import nn

PACKED_ROWS = (4, 8, 16, 32)  # row counts packed for (batch-1 trees; batched verify steps of several rows)
MEMORY_SHARE = 0.25  # of the memory available, what the packed copies may take


def available_memory() -> int | None:
    """Bytes of memory available now (Linux ``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def linear_bytes(target) -> int:
    """Bytes of the target's fp32 linear weights (what one packed copy costs)."""
    return sum(m.weight.numel() * 4 for m in target.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32)


def packed_rows(target, counts: tuple[int, ...] = PACKED_ROWS, available: int | None = None) -> tuple[int, ...]:
    """The row counts to pack for: the smallest of ``counts`` first, as many as fit in :data:`MEMORY_SHARE` of the
    memory ``available`` (default: read now; unknown: the smallest count alone)."""
    available = available_memory() if available is None else available
    each = max(linear_bytes(target), 1)
    fit = 1 if available is None else int(MEMORY_SHARE * available // each)
    return tuple(sorted(counts)[:fit])


def packing_available(target) -> bool:
    """fp32 weights on a CPU with PyTorch's MKL packed-GEMM ops (how many row counts memory allows:
    :func:`packed_rows`)."""
    weight = target.get_output_embeddings().weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def row_counts(target, counts: tuple[int, ...] | int | None) -> tuple[int, ...]:
    """``counts`` as a sorted tuple (None: :func:`packed_rows`); each at least 2."""
    counts = packed_rows(target) if counts is None else (counts,) if isinstance(counts, int) else counts
    if not counts or min(counts) < 2:
        raise ValueError(f"packed row counts must be 2 or more, got {counts!r}")
    return tuple(sorted(set(counts)))


class PackedLinears:
    """``with PackedLinears(target):`` routes the target's fp32 ``nn.Linear`` calls with 2..``rows`` input rows
    through MKL's packed GEMM (weights packed once per row count of ``counts``, at construction; ``counts=None``:
    :func:`packed_rows`). Re-entrant; the modules' own ``forward`` is back on exit."""

    def __init__(self, target, counts: tuple[int, ...] | int | None = None):
        if not packing_available(target):
            raise ValueError("packed linears need fp32 weights on a CPU with MKL")
        self.counts = row_counts(target, counts)
        self.rows = self.counts[-1]
        self._depth = 0
        # module -> (its weight, detached; the weight's version when packed; {row count: packed copy})
        self._packed: dict[nn.Linear, tuple[torch.Tensor, int, dict[int, torch.Tensor]]] = {}
        with torch.no_grad():
            for module in target.modules():
                if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
                    w = module.weight.detach()
                    self._packed[module] = (w, w._version, {
                        n: torch.ops.mkl._mkl_reorder_linear_weight(w, n) for n in self.counts})
        self._saved: dict[nn.Linear, object] = {}

    def __enter__(self) -> "PackedLinears":
        if self._depth == 0:
            for module in self._packed:
                self._saved[module] = module.__dict__.get("forward")  # an instance forward (e.g. a hook's), or None
                module.forward = partial(self._forward, module, module.forward)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for module, forward in self._saved.items():
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward
            self._saved.clear()

    def _forward(self, module: nn.Linear, stock, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N]: the packed GEMM where it applies, else the module's own forward."""
        w, version, packs = self._packed[module]
        m = x.numel() // x.shape[-1]
        if (not 1 < m <= self.rows or w._version != version or module.weight.data_ptr() != w.data_ptr()
                or x.dtype != torch.float32):
            return stock(x)  # one row, too many, or a weight changed (in place or replaced) since it was packed
        rows = next(n for n in self.counts if n >= m)
        x2 = x.reshape(m, x.shape[-1])  # [M, K]
        if m < rows:
            x2 = torch.cat([x2, x2.new_zeros(rows - m, x2.shape[1])])  # [rows, K]
        y = torch.ops.mkl._mkl_linear(x2, packs[rows], w, module.bias, rows)[:m]  # [M, N]
        return y.reshape(*x.shape[:-1], module.weight.shape[0])


class VerifyKernels:
    """Which verify forwards take the packed path: those of ``first`` .. ``rows`` tree tokens (where the probe
    measured it faster than the stock kernels). The weights are packed on first use (a one-time cost per
    process), or ``packed`` is reused (the probe's own)."""

    def __init__(self, target, first: int, counts: tuple[int, ...] | int | None = None,
                 packed: PackedLinears | None = None):
        self.target, self.first, self._packed = target, first, packed
        self.counts = packed.counts if packed is not None else row_counts(target, counts)
        self.rows = self.counts[-1]

    def prepare(self) -> None:
        """Pack now (once), so that no decoding step pays for it."""
        if self._packed is None:
            self._packed = PackedLinears(self.target, self.counts)

    def context(self, tokens: int):
        """A context manager for a verify forward of ``tokens`` tree tokens."""
        if not self.first <= tokens <= self.rows:
            return contextlib.nullcontext()
        self.prepare()
        return self._packed
