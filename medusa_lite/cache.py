"""The only module touching transformers' cache internals.

After a verify pass the cache holds prefix + every tree node; we keep prefix + the accepted path.
Only the plain ``DynamicCache`` of full-attention layers can be compacted this way: sliding-window
layers may already have evicted prefix entries and recurrent / linear-attention states cannot be
rewound, so such models are refused with a clear error.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .config import text_config


class UnsupportedCacheError(ValueError):
    """The target's KV cache cannot keep an arbitrary subset of the tokens it just appended."""


def new_cache(model) -> DynamicCache:
    """A fresh ``DynamicCache`` for ``model``; refuses models whose layers are not full attention."""
    cache = DynamicCache(config=text_config(model.config))
    check_cache(cache)
    return cache


def check_cache(cache) -> None:
    """Raise :class:`UnsupportedCacheError` unless every layer is a plain full-attention ``DynamicLayer``."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"medusa_lite needs a DynamicCache, the model uses {type(cache).__name__}")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise UnsupportedCacheError(
                f"cache layer {i} is a {type(layer).__name__} (sliding-window, recurrent or linear attention): "
                "tree verification needs to keep an arbitrary subset of the appended tokens, which this layer "
                "cannot do exactly, so medusa_lite refuses this model rather than change its output")


def keep_accepted(cache: DynamicCache, prefix_len: int, accepted: torch.Tensor) -> None:
    """Keep cache positions ``[0, prefix_len)`` plus ``prefix_len + accepted``; drop every other tree node.

    accepted: [a] long node indices in increasing order (root first). Only the accepted entries move:
    they are copied in place to ``prefix_len .. prefix_len + a`` and the tensors are narrowed (a view).
    """
    a = accepted.numel()
    src = accepted + prefix_len  # [a]
    contiguous = bool(accepted[-1] == a - 1)  # accepted nodes 0..a-1 already sit where they belong
    for layer in cache.layers:
        if not contiguous:
            layer.keys[:, :, prefix_len:prefix_len + a] = layer.keys.index_select(2, src)
            layer.values[:, :, prefix_len:prefix_len + a] = layer.values.index_select(2, src)
        layer.keys = layer.keys[:, :, :prefix_len + a]
        layer.values = layer.values[:, :, :prefix_len + a]


def extend_cache(cache: DynamicCache, tokens: int, generator: torch.Generator | None = None) -> None:
    """Append ``tokens`` random entries to every layer (shapes, dtype and device as the layer's own).

    For latency measurements only: attention costs the same whatever the keys hold, and this builds a
    long cache in milliseconds where a prefill of that length would take seconds.
    """
    if tokens <= 0:
        return
    for i, layer in enumerate(cache.layers):
        shape = list(layer.keys.shape)
        shape[2] = tokens
        keys = torch.randn(shape, generator=generator).to(layer.keys)
        values = torch.randn(shape[:3] + [layer.values.shape[3]], generator=generator).to(layer.values)
        cache.update(keys, values, i)
