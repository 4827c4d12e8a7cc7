"""The heads' optimiser, scheduler, accumulation, clipping and checkpoints: DeepSpeed (ZeRO-2/3) owns them all,
on one CPU process as on many GPUs; batch size and precision come from the training config."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from medusa_lite.paths import resolve_config

from .config import TrainConfig
from .runtime import Runtime, barrier


def load_deepspeed_config(cfg: TrainConfig, rt: Runtime) -> dict[str, Any]:
    """The DeepSpeed JSON with batch size, precision and clipping injected from the training config."""
    ds = json.loads(resolve_config("deepspeed", cfg.deepspeed).read_text())
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.micro_batch_size * cfg.grad_accum * rt.world
    ds["gradient_clipping"] = cfg.grad_clip
    # bf16 master/compute on CUDA; on CPU the heads stay fp32 and matmuls run under bf16 autocast
    ds["bf16"] = {"enabled": cfg.precision == "bf16" and rt.device.type == "cuda"}
    ds["fp16"] = {"enabled": False}
    ds.setdefault("steps_per_print", 10**9)
    ds["zero_allow_untested_optimizer"] = True
    return ds


class TrainClock:
    """Wall seconds a run has trained (across resumes) as a fraction of its time limit: the learning-rate schedule's
    second clock. A schedule sized at another machine's speed can be far longer than the time limit allows here (a
    run can stop with its learning rate still halfway down the cosine, and end worse than it began); the rate decays
    by whichever clock is further on, so a run its time limit stops ends decayed, as one that reaches ``max_steps``."""

    def __init__(self, limit_minutes: float | None):
        self.limit_s = 60 * limit_minutes if limit_minutes else None
        self.before_s, self.started = 0.0, None

    def start(self, before_seconds: float = 0.0) -> None:
        """Count from now, after ``before_seconds`` trained by the runs this one resumes."""
        self.before_s, self.started = before_seconds, time.time()

    def fraction(self) -> float:
        if self.limit_s is None or self.started is None:
            return 0.0
        return (self.before_s + time.time() - self.started) / self.limit_s


def lr_lambda(cfg: TrainConfig, clock: TrainClock | None = None):
    """Linear warm-up over ``warmup_steps``, then cosine from the peak to a tenth of it, by steps towards
    ``max_steps`` or by time towards the time limit, whichever is further on."""
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        progress = max(progress, clock.fraction() if clock is not None else 0.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return fn


class Engine:
    """The heads' optimiser, scheduler, accumulation, clipping and checkpoints: DeepSpeed (ZeRO-2/3) owns them
    all, on one CPU process as on many GPUs."""

    def __init__(self, cfg: TrainConfig, drafter: torch.nn.Module, rt: Runtime):
        import deepspeed

        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.clock = TrainClock(cfg.time_limit_minutes)  # the training loop starts it
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, self.clock))
        self.rt = rt
        self.ds_config = load_deepspeed_config(cfg, rt)
        self.module, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=drafter, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
        self.drafter = drafter

    @property
    def zero_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)

    def step(self) -> None:
        """After every micro step: DeepSpeed steps the optimiser at accumulation boundaries."""
        self.module.step()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save_checkpoint(self, directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> None:
        """DeepSpeed's checkpoint of this step; only the newest ``keep`` are kept (0: all)."""
        self.module.save_checkpoint(str(directory), tag=f"step{step}", client_state=state)
        if keep and self.rt.rank == 0:
            import shutil

            tags = sorted((p for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                          key=lambda p: int(p.name[4:]))
            for old in tags[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier(self.rt)

    def load_checkpoint(self, directory: Path) -> dict[str, Any] | None:
        """The client state of the latest checkpoint in ``directory`` (weights, optimiser and scheduler restored),
        or None when there is none."""
        if not (directory / "latest").is_file():
            return None
        path, state = self.module.load_checkpoint(str(directory))
        return state if path is not None else None

    def gathered(self, modify: bool = False):
        """Context in which the full head parameters are materialised (ZeRO-3 partitions them); ``modify``: what
        rank 0 writes into them is every rank's after it."""
        import contextlib

        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.drafter.parameters()),
                                                     modifier_rank=0 if modify else None)
        return contextlib.nullcontext()
