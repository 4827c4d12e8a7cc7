"""Cheaper multi-token verification on CPU: the target's linear layers through prepacked MKL GEMM.

On a CPU, a verify forward of a few tree tokens is a set of small-M GEMMs (M = tree tokens). MKL's
ordinary fp32 GEMM pays a packing step for M >= 2 that a one-token GEMV does not (on an AVX2-only CPU
two tokens cost ~1.6x one through the 49152 x 576 ``lm_head``), so the forward costs far more than
reading the weights once. With the weights packed once (``torch.ops.mkl._mkl_reorder_linear_weight``),
MKL's packed GEMM skips that step; it is used for exactly the packed row count, so inputs of
2..``rows`` rows are zero-padded to ``rows`` (the padding rows' outputs are dropped).

:class:`PackedLinears` is a ``TorchFunctionMode``: while it is active (verify forwards only, and only for
the tree sizes where the probe measured it faster), ``F.linear`` on one of the target's fp32 CPU linear
weights takes the packed path; everything else, and the whole model outside the mode, is untouched.
No modeling code is forked. The packed copy costs as much memory as the linear weights. Results differ
from ``F.linear`` only in summation order (as any two GEMM kernels do), so greedy output stays the
target's own up to floating-point ties, like every tree forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

PACKED_ROWS = 8


def packing_available(target) -> bool:
    """fp32 weights on a CPU with PyTorch's MKL packed-GEMM ops."""
    weight = target.get_output_embeddings().weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class PackedLinears(TorchFunctionMode):
    """``with PackedLinears(target):`` routes the target's fp32 ``F.linear`` calls with 2..``rows`` input rows
    through MKL's packed GEMM (weights packed once, at construction)."""

    def __init__(self, target, rows: int = PACKED_ROWS):
        super().__init__()
        if not packing_available(target):
            raise ValueError("packed linears need fp32 weights on a CPU with MKL")
        self.rows = rows
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # data_ptr -> (weight, version, packed)
        with torch.no_grad():
            for module in target.modules():
                if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
                    w = module.weight.detach()
                    self._packed[w.data_ptr()] = (w, w._version, torch.ops.mkl._mkl_reorder_linear_weight(w, rows))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            out = self._linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """[..., K] x packed [N, K] -> [..., N]; None where the packed path does not apply."""
        entry = self._packed.get(weight.data_ptr())
        if (entry is None or entry[0].shape != weight.shape or entry[1] != weight._version
                or x.dtype != torch.float32):  # not ours, or changed in place since it was packed: the stock path
            return None
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        m = x2.shape[0]
        if not 1 < m <= self.rows:
            return None
        if m < self.rows:
            x2 = torch.cat([x2, x2.new_zeros(self.rows - m, x2.shape[1])])  # [rows, K]
        y = torch.ops.mkl._mkl_linear(x2, entry[2], entry[0], bias, self.rows)[:m]  # [M, N]
        return y.reshape(*x.shape[:-1], weight.shape[0])


class VerifyKernels:
    """Which verify forwards take the packed path: those of ``first`` .. ``rows`` tree tokens (where the probe
    measured it faster than the stock kernels). The weights are packed on first use (a one-time cost per
    process), or ``packed`` is reused (the probe's own)."""

    def __init__(self, target, first: int, rows: int = PACKED_ROWS, packed: PackedLinears | None = None):
        self.target, self.first, self.rows = target, first, rows
        self._packed = packed

    def prepare(self) -> None:
        """Pack now (once), so that no decoding step pays for it."""
        if self._packed is None:
            self._packed = PackedLinears(self.target, self.rows)

    def context(self, tokens: int):
        """A context manager for a verify forward of ``tokens`` tree tokens."""
        if not self.first <= tokens <= self.rows:
            return contextlib.nullcontext()
        self.prepare()
        return self._packed
