"""Cheaper forwards on CPU: the target's (and the drafter's) linear layers through a GEMM made for a few rows.

On a CPU, a verify forward of a few tree tokens is a set of small-M GEMMs (M = tree tokens). The stock kernels are
far from the cost of reading the weights once: on AVX2 kernels two fp32 tokens cost ~1.7x one through MKL's GEMM
(a packing step a one-token GEMV does not pay), and even the one-token GEMV streams the weights at ~10 GB/s where
the memory gives 25+. Two paths replace them while a forward of the fitted decoding runs:

* :class:`SkinnyLinears` (the default where it builds; fp32 and bf16 weights): our own AVX2 + FMA kernel
  (``csrc/skinny_linear.cpp``, compiled on first use by ``torch.utils.cpp_extension`` into its folder of
  extensions; needs a C++ compiler). The weights are packed once into panels of 16 output features, one copy for
  every row count, and streamed once per call whatever M is, prefetched ahead of the arithmetic: on an AVX2 CPU a
  forward of 1-6 tokens costs about half what the stock kernels' one-token forward costs. The drafter's own linears take
  it too (:func:`drafting_linears`).
* :class:`PackedLinears`: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, weights packed once per row count of
  :data:`PACKED_ROWS` by ``_mkl_reorder_linear_weight``; an input of m rows is zero-padded to the smallest count
  >= m), fp32 only. The fallback where no compiler is found (``MEDUSA_LITE_SKINNY=0`` forces it): a 2-token verify
  forward costs ~1.25x one token.

Both are context managers: while active (verify forwards, only for the tree sizes where the probe measured them
faster), each eligible ``nn.Linear`` takes the packed path (its ``forward`` is shadowed by an instance attribute,
restored on exit; a decoding loop holds the modules patched for its whole run and each forward's context only
switches the path on, ``held``); everything else, and the whole model outside the context, is untouched. No
modeling code is forked. (Not a ``TorchFunctionMode``: it would intercept every torch call of the forward, ~2,600
per forward of the default model, ~10 ms of Python per verify step.) Each packed copy costs as much memory as the linear
weights, so only as many copies are made as fit in a quarter of the memory available (:func:`packed_rows`,
:func:`skinny_available`). Results differ from ``F.linear`` only in summation order (as any two GEMM kernels do),
so greedy output stays the target's own up to floating-point ties, like every tree forward.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
from torch import nn

from .attention import attending, routed

PACKED_ROWS = (4, 8, 16, 32)  # MKL: row counts packed for (batch-1 trees; batched verify steps of several rows)
SKINNY_ROWS = 32  # the skinny kernel: any row count up to this (its one packed copy serves them all)
SKINNY_DTYPES = (torch.float32, torch.bfloat16)  # weight dtypes it takes (bf16: widened to fp32 in registers)
MEMORY_SHARE = 0.25  # of the memory available, what the packed copies may take
# at::parallel_for is inline OpenMP: built without it, a kernel runs on one thread whatever torch's thread count
# (GCC links the libgomp that torch has loaded already; Apple's clang has no -fopenmp)
BUILD_FLAGS = ("-O3", "-fopenmp") if sys.platform.startswith("linux") else ("-O3",)
_SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
_ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "small_attention.cpp"


def _build_id(source: Path) -> str:
    """Names a kernel's build and keys the fits that timed it: its source and the flags it is built with."""
    return hashlib.sha256(source.read_bytes() + " ".join(BUILD_FLAGS).encode()).hexdigest()[:12]


SKINNY_SOURCE_ID = _build_id(_SOURCE)
ATTENTION_SOURCE_ID = _build_id(_ATTENTION_SOURCE)


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


def linear_bytes(target, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Bytes of the target's linear weights of ``dtypes`` (what one packed copy of them costs)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in target.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in dtypes)


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


class _PatchedLinears:
    """``with linears:`` routes the target's eligible ``nn.Linear`` calls with ``min_rows``..``rows`` input rows through
    :meth:`_linear` (weights packed once per module, at construction, by :meth:`_pack`). Re-entrant; the modules'
    own ``forward`` is back on exit. Patching the modules costs ~1 ms for the default model's 211: a decoding loop
    that enters once per forward holds them patched for its whole run (:meth:`held`), and each ``with`` then only
    switches the path on (a patched module outside it runs its own forward)."""

    counts: tuple[int, ...]
    rows: int
    source_id = ""  # what a fit timing this path keys on besides its name (the kernel's source, where it is ours)
    min_rows = 2  # fewer rows take the stock kernel (a one-token forward must stay plain decoding's own)

    def __init__(self, target):
        self._depth = 0  # active: inside ``with``
        self._holds = 0  # patched while > 0 even when not active (``held``)
        # module -> (its weight, detached; the weight's version when packed; its packed copy or copies)
        self._packed: dict[nn.Linear, tuple[torch.Tensor, int, object]] = {}
        with torch.no_grad():
            for module in target.modules():
                if self._eligible(module):
                    w = module.weight.detach()
                    self._packed[module] = (w, w._version, self._pack(w))
        self._saved: dict[nn.Linear, object] = {}

    def _eligible(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and module.weight.dtype == torch.float32

    def _pack(self, w: torch.Tensor):
        raise NotImplementedError

    def _linear(self, x2: torch.Tensor, w: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        """[M, K] -> [M, N] through the packed copy ``packed`` of ``w``."""
        raise NotImplementedError

    def __enter__(self):
        self._patch()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        self._unpatch()

    @contextlib.contextmanager
    def held(self):
        """The modules patched for the whole block; the packed path runs only inside ``with self``."""
        self._patch()
        self._holds += 1
        try:
            yield self
        finally:
            self._holds -= 1
            self._unpatch()

    def _patch(self) -> None:
        if self._saved or not self._packed:
            return
        for module in self._packed:
            self._saved[module] = module.__dict__.get("forward")  # an instance forward (e.g. a hook's), or None
            module.forward = partial(self._forward, module, module.forward)

    def _unpatch(self) -> None:
        if self._depth or self._holds:
            return
        for module, forward in self._saved.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward
        self._saved.clear()

    def _forward(self, module: nn.Linear, stock, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N]: the packed path where it applies, else the module's own forward."""
        w, version, packed = self._packed[module]
        m = x.numel() // x.shape[-1]
        if (not self._depth or not self.min_rows <= m <= self.rows or w._version != version
                or module.weight.data_ptr() != w.data_ptr() or x.dtype != w.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return stock(x)  # held but not active, too few rows or too many, a weight changed (in place or replaced)
            # since it was packed, or a forward that needs gradients (the packed paths have none)
        y = self._linear(x.reshape(m, x.shape[-1]), w, packed, module.bias)  # [M, N]
        return y.reshape(*x.shape[:-1], module.weight.shape[0])


class PackedLinears(_PatchedLinears):
    """MKL's packed GEMM for 2..``rows`` rows: weights packed once per row count of ``counts`` (None:
    :func:`packed_rows`), an input padded to the smallest count that holds it."""

    def __init__(self, target, counts: tuple[int, ...] | int | None = None):
        if not packing_available(target):
            raise ValueError("packed linears need fp32 weights on a CPU with MKL")
        self.counts = self.row_counts(target, counts)
        self.rows = self.counts[-1]
        super().__init__(target)

    @staticmethod
    def row_counts(target, counts: tuple[int, ...] | int | None) -> tuple[int, ...]:
        """The counts packed for (:func:`row_counts`)."""
        return row_counts(target, counts)

    def _pack(self, w: torch.Tensor) -> dict[int, torch.Tensor]:
        return {n: torch.ops.mkl._mkl_reorder_linear_weight(w, n) for n in self.counts}

    def _linear(self, x2, w, packed, bias):
        m = x2.shape[0]
        rows = next(n for n in self.counts if n >= m)
        if m < rows:
            x2 = torch.cat([x2, x2.new_zeros(rows - m, x2.shape[1])])  # [rows, K]
        return torch.ops.mkl._mkl_linear(x2, packed[rows], w, bias, rows)[:m]  # [M, N]


class SkinnyLinears(_PatchedLinears):
    """Our AVX2 skinny GEMM for ``min_rows``..:data:`SKINNY_ROWS` rows (:func:`skinny_kernel`): one packed copy of
    each eligible weight serves every row count, one row included (a one-token forward streams the weights ~2x
    faster than the stock GEMV on an AVX2 CPU, and up to 6 rows cost about what one does)."""

    counts = (SKINNY_ROWS,)
    rows = SKINNY_ROWS
    source_id = SKINNY_SOURCE_ID  # a changed kernel is timed afresh

    def __init__(self, target, counts=None, *, min_rows: int = 1):  # counts: the shared signature; one copy serves all
        self._kernel = skinny_kernel()
        if self._kernel is None:
            raise ValueError("the skinny kernel needs an AVX2 CPU and a C++ compiler")
        self.min_rows = min_rows
        super().__init__(target)

    @classmethod
    def row_counts(cls, target, counts=None) -> tuple[int, ...]:
        """One copy serves every count up to :data:`SKINNY_ROWS`, whatever ``counts`` asks."""
        return cls.counts

    def _eligible(self, module: nn.Module) -> bool:
        return (isinstance(module, nn.Linear) and module.weight.dtype in SKINNY_DTYPES
                and module.weight.device.type == "cpu")

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return self._kernel.pack_weight(w.contiguous())  # [ceil(N/16), K, 16]

    def _linear(self, x2, w, packed, bias):
        return self._kernel.skinny_linear(x2, packed, w.shape[0], bias)  # [M, N]


@cache
def skinny_kernel():
    """The compiled skinny GEMM extension (built once per machine by ``torch.utils.cpp_extension``, loaded once per process),
    or None where it cannot be built (no compiler, no AVX2 kernels, or ``MEDUSA_LITE_SKINNY=0``)."""
    return _extension("skinny", _SOURCE, SKINNY_SOURCE_ID, "MEDUSA_LITE_SKINNY", "the skinny verify kernel",
                      "falling back to MKL's packed GEMM")


@cache
def attention_kernel():
    """The compiled few-query attention extension (``csrc/small_attention.cpp``; see :mod:`medusa_lite.attention`),
    or None where it cannot be built (no compiler, no AVX2 kernels, or ``MEDUSA_LITE_ATTENTION=0``)."""
    return _extension("attention", _ATTENTION_SOURCE, ATTENTION_SOURCE_ID, "MEDUSA_LITE_ATTENTION",
                      "the few-query attention kernel", "torch's SDPA instead")


STALE_LOCK_SECONDS = 600  # a build takes well under a minute: a lock this old was left by a process killed mid-build


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock is a bare file: a process killed while building leaves it, and every later process would
    wait on it forever. One older than :data:`STALE_LOCK_SECONDS` is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"removing {lock}, left {age / 60:.0f} min ago by a build that did not finish")
        lock.unlink(missing_ok=True)


def _extension(kind: str, source: Path, source_id: str, switch: str, what: str, fallback: str):
    """Build (once per machine and source) and load (once per process) the C++ extension ``source``; None where it
    cannot be built or the environment variable ``switch`` is 0."""
    if os.environ.get(switch, "1").lower() in ("0", "off", "false", "no"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils import cpp_extension  # heavy: imported only here

    name = f"medusa_lite_{kind}_{source_id}"
    try:
        build = Path(cpp_extension._get_build_directory(name, verbose=False))  # $TORCH_EXTENSIONS_DIR/<name>
    except Exception:  # a private helper of torch's: only used to say so when a build is coming
        build = None
    if build is not None:
        _clear_stale_lock(build / "lock")
        if not any(build.glob("*.so")):
            warnings.warn(f"compiling {what} into {build} (once per machine, ~30 s)")
    try:
        with _ninja_on_path():
            return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(BUILD_FLAGS),
                                      extra_ldflags=[f for f in BUILD_FLAGS if f == "-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, no Python headers: the stock path instead
        warnings.warn(f"{what} did not build ({type(e).__name__}: {str(e)[:200]}); {fallback}")
        return None


@contextlib.contextmanager
def _ninja_on_path():
    """The ``ninja`` of the ``ninja`` package on ``PATH`` while a build runs (a venv's scripts are not on ``PATH``
    unless it is activated)."""
    path = os.environ.get("PATH", "")
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    except (ImportError, AttributeError):
        pass
    try:
        yield
    finally:
        os.environ["PATH"] = path


def skinny_available(target) -> bool:
    """fp32 or bf16 weights on a CPU, and one packed copy fits :data:`MEMORY_SHARE` of the memory available
    (whether the CPU has AVX2 and the kernel compiles: :func:`skinny_kernel`)."""
    weight = target.get_output_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype not in SKINNY_DTYPES:
        return False
    available = available_memory()
    return available is None or linear_bytes(target, SKINNY_DTYPES) <= MEMORY_SHARE * available


def verify_linears(target) -> tuple[type[_PatchedLinears], tuple[int, ...]] | None:
    """The packed path this machine gives ``target`` and its row counts: the skinny kernel where it builds, else
    MKL's packed GEMM for as many counts as memory allows, else None (the stock kernels)."""
    if skinny_available(target) and skinny_kernel() is not None:
        return SkinnyLinears, SkinnyLinears.counts
    counts = packed_rows(target) if packing_available(target) else ()
    return (PackedLinears, counts) if counts else None


def drafting_linears(drafter) -> SkinnyLinears | None:
    """The drafter's own linears through the skinny kernel for every row count, one row included (a draft only has
    to be what the acceptance rule is given, not plain decoding's numbers), where the kernel builds and the drafter
    is fp32 or bf16 on a CPU; else None. Its forwards are one-token GEMVs the stock kernels run at half the
    memory's speed: on an AVX2 CPU drafting a 5-level tree costs ~26 ms through them."""
    weights = [m.weight for m in drafter.modules() if isinstance(m, nn.Linear)]
    if (not weights or any(w.device.type != "cpu" or w.dtype not in SKINNY_DTYPES for w in weights)
            or skinny_kernel() is None):
        return None
    return SkinnyLinears(drafter, min_rows=1)


class VerifyKernels:
    """Which verify forwards take the packed path (``kind``: :class:`SkinnyLinears` or :class:`PackedLinears`):
    those of ``first`` .. ``last`` tree tokens (where the probe measured it faster than the stock kernels; 0: up to
    the path's rows). The weights are packed on first use (a one-time cost per process), or ``packed`` is reused
    (the probe's own)."""

    def __init__(self, target, first: int, counts: tuple[int, ...] | int | None = None,
                 packed: _PatchedLinears | None = None, kind: type[_PatchedLinears] = PackedLinears,
                 last: int = 0):
        self.target, self.first, self._packed = target, first, packed
        self.kind = type(packed) if packed is not None else kind
        self.counts = packed.counts if packed is not None else kind.row_counts(target, counts)
        self.rows = min(self.counts[-1], last) if last else self.counts[-1]  # last: the largest size that won

    def prepare(self) -> None:
        """Pack now (once), so that no decoding step pays for it."""
        if self._packed is None:
            self._packed = self.kind(self.target, self.counts)

    def held(self):
        """The modules patched for a decoding loop's whole run (:meth:`_PatchedLinears.held`); packs first."""
        self.prepare()
        return self._packed.held()

    def context(self, tokens: int):
        """A context manager for a verify forward of ``tokens`` tree tokens."""
        if not self.first <= tokens <= self.rows:
            return contextlib.nullcontext()
        self.prepare()
        return self._packed


@dataclass(frozen=True)
class Kernels:
    """The CPU kernels one model decodes with, chosen together (by the fit, :mod:`medusa_lite.fit`; unfitted:
    :meth:`defaults`). ``linears``: the target's linears for the verify forwards of the sizes where the probe measured
    them faster (:class:`VerifyKernels`; None: the stock kernels); ``draft_linears``: the drafter's own linears
    (:func:`drafting_linears`; None: stock); ``attention``: the few-query attention kernel (:func:`attention_kernel`;
    None: SDPA alone), besides the grouped heads every CPU forward of medusa_lite's attends with
    (:mod:`medusa_lite.attention`).

    They touch only this model's own modules and only inside these contexts: :meth:`held` for a decoding loop's whole
    run (the attention routed, the linears patched once), then per forward :meth:`prefill`, :meth:`verify` and
    :meth:`drafting`, each a switch. Nothing of torch or transformers is replaced, at import or ever."""

    linears: VerifyKernels | None = None
    draft_linears: SkinnyLinears | None = None
    attention: object | None = None

    @classmethod
    def defaults(cls, target, **chosen) -> Kernels:
        """``target``'s kernels with those ``chosen`` (``linears``, ``draft_linears``): the few-query attention
        kernel where the target computes on a CPU and it builds."""
        cpu = target.get_output_embeddings().weight.device.type == "cpu"
        return cls(attention=attention_kernel() if cpu else None, **chosen)

    @contextlib.contextmanager
    def held(self, target):
        """``target`` (and the drafter's linears) ready for a decoding loop's forwards: its attention routed and the
        linears patched once for the block (each forward's context then only switches them on)."""
        with routed(target), _held(self.linears), _held(self.draft_linears):
            yield self

    def prefill(self, target):
        """A prompt's forward: the grouped heads as they are (no few-query kernel, no packed linears)."""
        return attending(target)

    @contextlib.contextmanager
    def verify(self, target, tokens: int, single_query: bool = False):
        """A verify forward of ``tokens`` tree tokens, all rows together (``single_query``: one token, no mask)."""
        with attending(target, single_query, self.attention), \
                self.linears.context(tokens) if self.linears is not None else contextlib.nullcontext():
            yield

    def drafting(self):
        """The drafter's forwards (``propose``, ``commit``): its linears through the skinny kernel where chosen."""
        return self.draft_linears if self.draft_linears is not None else contextlib.nullcontext()


def _held(linears):
    return linears.held() if linears is not None else contextlib.nullcontext()
