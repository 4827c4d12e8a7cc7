"""A target larger than one device (``shard_target``): its decoder layers partitioned across the ranks with DeepSpeed
ZeRO-3, every other parameter (the embeddings, the lm_head, the final norm: what the drafter reads at every step and
decoding needs) whole on each rank.

The layers load partitioned (transformers' ZeRO-3 loading under :func:`partitioned_loading`: parameters are
partitioned as they are made and filled one module at a time, so no rank holds the whole target), and each layer's
parameters are gathered for its forward and released after it (:class:`ShardedTarget`). Every target forward is
therefore collective, and every rank runs as many: the feature pass pads a rank's last batches
(``compute_features(lockstep=True)``), training steps take as many windows on each rank, the held-out windows are
padded too (``evaluate``), and the acceptance decode runs on rank 0 while the others lend it their shards
(:meth:`ShardedTarget.lead`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from medusa_lite._hf import text_config

from .config import TrainConfig
from .runtime import Runtime


@contextlib.contextmanager
def partitioned_loading(cfg: TrainConfig, rt: Runtime):
    """Within: ``from_pretrained`` makes the target under ``deepspeed.zero.Init`` (partitioned over the ranks) and
    loads its weights into the partitions; nothing when ``shard_target`` is off."""
    if not cfg.shard_target:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from medusa_lite.targets import resolve_dtype

    dtype = resolve_dtype(cfg.dtype, rt.device)
    # memory_efficient_linear off: it would replace torch.nn.functional.linear for the whole process
    ds = {"zero_optimization": {"stage": 3, "memory_efficient_linear": False}, "train_micro_batch_size_per_gpu": 1,
          "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}
    config = HfDeepSpeedConfig(ds)  # transformers holds a weak reference: it must live while the target loads
    try:
        yield
    finally:
        del config
        unset_hf_deepspeed_config()


def decoder_layers(target) -> torch.nn.ModuleList:
    """The target's decoder layers: the ModuleList of ``num_hidden_layers`` modules holding the most parameters."""
    count = text_config(target.config).num_hidden_layers
    found = [m for m in target.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not found:
        raise ValueError(f"shard_target: no list of {count} decoder layers in {type(target).__name__}")
    return max(found, key=lambda m: sum(_numel(p) for p in m.parameters()))


def _numel(p: torch.Tensor) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()


def held_parameters(target) -> tuple[int, int]:
    """(parameters this rank holds now, the target's parameters): a partitioned parameter counts its local partition
    (and its full tensor while gathered), any other parameter its whole tensor. Counted, not derived from the
    partitioning's intent."""
    held = total = 0
    for p in target.parameters():
        held += p.ds_tensor.numel() + p.data.numel() if hasattr(p, "ds_tensor") else p.numel()
        total += _numel(p)
    return held, total


class ShardedTarget:
    """A target loaded under :func:`partitioned_loading`: its decoder layers stay partitioned, each gathered for its
    own forward; every other parameter is made whole on every rank (and no longer partitioned)."""

    def __init__(self, target, rt: Runtime):
        self.layers, self.rt = decoder_layers(target), rt
        self._gathered: dict[int, Any] = {}
        self._leading = False
        self._make_whole_outside(target)
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(functools.partial(self._before, i))
            layer.register_forward_hook(functools.partial(self._after, i))
        self.largest_layer = max(sum(_numel(p) for p in layer.parameters()) for layer in self.layers)
        target.__dict__["_medusa_lite_shard"] = self  # (not a submodule)

    @staticmethod
    def of(target) -> ShardedTarget | None:
        """The :class:`ShardedTarget` of ``target``, None for a whole one."""
        return target.__dict__.get("_medusa_lite_shard")

    def _make_whole_outside(self, target) -> None:
        import deepspeed

        inside = {id(p) for p in self.layers.parameters()}
        outside = [p for p in target.parameters() if id(p) not in inside]  # (tied weights once)
        with deepspeed.zero.GatheredParameters(outside):
            whole = {id(p): torch.nn.Parameter(p.data.clone(), requires_grad=False) for p in outside}
        for module in target.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in whole:
                    module._parameters[name] = whole[id(p)]  # a tied weight gets the same new parameter

    def _before(self, i: int, module, args) -> None:
        if self._leading:  # the followers gather layer i with the leader
            dist.broadcast(torch.tensor([i], device=self.rt.device), src=0)
        self._gather(i)

    def _after(self, i: int, module, args, output) -> None:
        self._release(i)

    def _gather(self, i: int) -> None:
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(self.layers[i].parameters()))
        context.__enter__()
        self._gathered[i] = context

    def _release(self, i: int) -> None:
        self._gathered.pop(i).__exit__(None, None, None)

    def lead(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by rank 0 alone (its result there; None elsewhere): the other ranks gather every layer it runs
        with it, as rank 0 names them (a broadcast layer index; -1 ends), so it need not be a computation every rank
        could repeat step for step."""
        signal = torch.zeros(1, dtype=torch.long, device=self.rt.device)
        if self.rt.rank == 0:
            self._leading = self.rt.world > 1
            try:
                return fn()
            finally:
                if self._leading:
                    self._leading = False
                    dist.broadcast(signal.fill_(-1), src=0)
        while True:
            dist.broadcast(signal, src=0)
            if int(signal) < 0:
                return None
            self._gather(int(signal))
            self._release(int(signal))

    def report(self, target) -> dict[str, Any]:
        """Every rank's measured share of the target's parameters (a collective call)."""
        held, total = held_parameters(target)
        shares = torch.zeros(self.rt.world, dtype=torch.float64, device=self.rt.device)
        shares[self.rt.rank] = held
        if self.rt.world > 1:
            dist.all_reduce(shares)
        return {"world": self.rt.world, "parameters": total, "held_per_rank": [int(x) for x in shares.tolist()],
                "fraction_per_rank": [round(x / total, 4) for x in shares.tolist()],
                "largest_layer_fraction": round(self.largest_layer / total, 4)}
