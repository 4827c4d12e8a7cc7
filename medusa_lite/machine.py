"""The machine a measurement depends on: CPU model and ISA flags, the fingerprint of a latency measurement, a one-line
description of it, and whether bf16 matmuls run natively (a leaf: imports no project module)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu_info() -> tuple[str, list[str]]:
    """(CPU model name, the ISA flags among :data:`_ISA_FLAGS`) from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return model, sorted(f for f in _ISA_FLAGS if f in flags)


def hardware_summary() -> str:
    """One line for a model card: the GPUs, else the CPU model and its core count."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU: {cpu_info()[0]}, {os.cpu_count()} cores"


def machine_fingerprint(device: torch.device | str, dtype: torch.dtype) -> dict:
    """What a latency measurement depends on. ``isa`` is the kernel class PyTorch dispatches to, which
    ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` can lower below what the CPU has."""
    import transformers

    device = torch.device(device)
    model, flags = cpu_info()
    fp = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
          "cpu": model, "cpu_flags": flags, "isa": torch.backends.cpu.get_cpu_capability(),
          "isa_limits": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                   "MKL_ENABLE_INSTRUCTIONS") if k in os.environ},
          "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        fp["gpu"] = torch.cuda.get_device_name(device)
    return fp


def describe(fp: dict) -> str:
    """One line naming a fingerprint (for logs and reports)."""
    where = fp.get("gpu") or f"{fp['cpu']} ({fp['isa']})"
    return f"{where}, {fp['threads']} thread(s), {fp['dtype']}, torch {fp['torch']}"


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` runs bf16 matmuls natively, and why: CUDA by its compute capability; a CPU when its
    flags have AVX-512-BF16 or AMX-BF16 and oneDNN may use them (``ONEDNN_MAX_CPU_ISA`` can forbid it).
    Elsewhere bf16 GEMMs are emulated and cost several times fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        ok = major >= 8  # Ampere and later have bf16 tensor cores; older GPUs only emulate bf16
        return ok, f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    model, flags = cpu_info()
    has = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    onednn_limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    allowed = (bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
               and "AVX512" in torch.backends.cpu.get_cpu_capability()
               and (onednn_limit in ("ALL", "DEFAULT") or "AVX512" in onednn_limit or "AMX" in onednn_limit))
    if has and allowed:
        return True, f"{model}: {', '.join(has)}"
    if has:
        return False, f"{model} has {', '.join(has)} but kernels are limited to {torch.backends.cpu.get_cpu_capability()}"
    return False, f"{model}: no bf16 matmul instructions (kernel class {torch.backends.cpu.get_cpu_capability()})"
