"""The process group training runs in: under the deepspeed launcher from its environment, alone a world of one."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import TrainConfig


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device


_OWN_WORLD = {"made": False}  # this process made its own world of one (kept for later runs in the process)


def init_runtime(cfg: TrainConfig) -> Runtime:
    """DeepSpeed's process group: under a launcher from its environment; alone, a world of one (gloo on CPU)."""
    import deepspeed

    from medusa_lite.targets import resolve_device

    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and ":" in str(cfg.device):  # every rank would take that one GPU
        raise ValueError(f"device {cfg.device!r} under a launcher: use auto or cuda (each rank takes its LOCAL_RANK's)")
    device = resolve_device(cfg.device)  # auto and cuda: this rank's CUDA device (LOCAL_RANK) where there is one
    # no launcher: a world of one. DeepSpeed reads these variables (LOCAL_RANK even after the init); a launcher
    # started later sets its own for its ranks, and the marker that this world is made up is not an env variable
    if "WORLD_SIZE" not in os.environ or _OWN_WORLD["made"]:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
        _OWN_WORLD["made"] = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu" and os.environ.get("MEDUSA_LITE_DS_SHM", "0") != "1":
        # DeepSpeed's CPU backend JIT-compiles a C++ shared-memory all-reduce on first use (minutes,
        # needs a compiler); plain gloo is plenty for the heads' gradients. MEDUSA_LITE_DS_SHM=1 keeps it.
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log0(rt: Runtime, *msg: Any) -> None:
    if rt.rank == 0:
        print(*msg, flush=True)


def leave(rt: Runtime) -> None:
    """End of a run. Launched ranks leave their process group (torn down at interpreter exit it can abort a
    rank); a world of one keeps it, since DeepSpeed holds on to it for the next run in this process."""
    barrier(rt)
    if not _OWN_WORLD["made"]:
        dist.destroy_process_group()


def barrier(rt: Runtime) -> None:
    if rt.world > 1:
        dist.barrier()


def all_reduce_host(tensor: torch.Tensor, rt: Runtime, chunk: int = 1 << 26) -> None:
    """Sum a CPU ``tensor`` over the ranks in place. NCCL reduces CUDA tensors only: on a GPU it goes through the
    device ``chunk`` elements at a time (a feature cache can be larger than a device's memory)."""
    if rt.world == 1:
        return
    if rt.device.type == "cpu":
        dist.all_reduce(tensor)
        return
    flat = tensor.view(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i: i + chunk].to(rt.device)
        dist.all_reduce(part)
        flat[i: i + chunk].copy_(part.cpu())
