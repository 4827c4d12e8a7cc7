"""The only module touching transformers' cache internals.

After a verify pass the cache holds prefix + every tree node; we keep prefix + the accepted path.

Two kinds of cache layer can do that exactly:

* full attention (``DynamicLayer``): every past key is kept; the accepted nodes are moved in place.
* sliding-window attention (``DynamicSlidingWindowLayer``): transformers keeps only the last
  ``window - 1`` keys, which is all the next tokens can see. With past recording on (the mechanism
  transformers 5.x uses to roll back assisted generation, :meth:`DynamicCache.activate_past_recording`)
  the layer keeps the tree's keys until :meth:`crop`, so the accepted nodes are moved in place and
  ``crop`` drops the rest and trims the layer back to ``window - 1`` keys: its memory stays bounded by
  window + tree. The verify pass gives these layers their own mask (:func:`tree_attention_mask`).

Recurrent, linear-attention, convolutional, hybrid and chunked layers are refused when the model is
wrapped (:func:`check_model`, called by ``MedusaModel(...)``), with an error naming the layer type:
their state after a tree of tokens mixes siblings, and cannot be rolled back to one path.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from ._hf import text_config
from .tree import TreeBuffers, attention_bias, sliding_attention_bias

FULL, SLIDING = "full_attention", "sliding_attention"
# cache layer class -> the layer type (and the key of transformers' per-type mask mapping) it serves
SUPPORTED_LAYERS = {DynamicLayer: FULL, DynamicSlidingWindowLayer: SLIDING}
_WHY = {
    "linear_attention": "a recurrent / state-space (Mamba-style) or linear-attention state",
    "conv": "a causal-convolution state",
    "hybrid": "a recurrent state next to its attention cache",
    "hybrid_sliding": "a recurrent state next to its attention cache",
    "chunked_attention": "chunked attention (its mask is not a window counted from each token)",
    "dummy": "a layer sharing another layer's cache (untested with tree verification)",
}


class UnsupportedCacheError(ValueError):
    """The target's KV cache cannot keep an arbitrary subset of the tokens it just appended."""


def layer_types(model_or_config) -> list[str]:
    """Each decoder layer's type as transformers' ``DynamicCache`` sees it (``'full_attention'``,
    ``'sliding_attention'``, ``'linear_attention'``, ...)."""
    config = getattr(model_or_config, "config", model_or_config)
    return list(get_layer_types_and_kwargs(text_config(config))[0])


def check_model(model) -> None:
    """Raise :class:`UnsupportedCacheError` (naming the layer and its type) unless tree verification is
    exact on ``model``: every cache layer full or sliding-window attention, one window for all sliding
    layers, and a forward that takes a cache. Called when the model is wrapped (``MedusaModel(...)``)."""
    params = inspect.signature(model.forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        raise UnsupportedCacheError(f"{type(model).__name__}.forward takes no KV cache: medusa_lite cannot verify "
                                    "a tree of tokens on it")
    check_cache(DynamicCache(config=text_config(model.config)), layer_types(model))


def new_cache(model) -> DynamicCache:
    """A fresh ``DynamicCache`` for ``model``; refuses models with layers tree verification cannot rewind."""
    cache = DynamicCache(config=text_config(model.config))
    check_cache(cache)
    return cache


def check_cache(cache, types: list[str] | None = None) -> None:
    """Raise :class:`UnsupportedCacheError` unless every layer is a full-attention ``DynamicLayer`` or a
    ``DynamicSlidingWindowLayer`` of sliding attention, all sliding layers with the same window."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"medusa_lite needs a DynamicCache, the model uses {type(cache).__name__}")
    windows = set()
    for i, layer in enumerate(cache.layers):
        kind = types[i] if types is not None and i < len(types) else None
        if type(layer) not in SUPPORTED_LAYERS or (kind is not None and kind != SUPPORTED_LAYERS[type(layer)]):
            why = _WHY.get(kind, "a cache layer other than full or sliding-window attention")
            raise UnsupportedCacheError(
                f"cache layer {i} is {kind or 'of type'} {type(layer).__name__!r}: {why}. Tree verification "
                "feeds every drafted branch through the layer at once and then keeps one path, which this "
                "layer's state cannot be rolled back to exactly, so medusa_lite refuses this model rather "
                "than change its output")
        if layer.is_sliding:
            windows.add(int(layer.sliding_window))
    if len(windows) > 1:
        raise UnsupportedCacheError(f"sliding-window layers with different windows {sorted(windows)}: transformers "
                                    "takes one mask for all of them")


def tree_attention_mask(cache: DynamicCache, buffers: TreeBuffers, cache_len: int,
                        dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The verify pass's attention mask: one 4D additive mask, or ``{layer type: mask}`` when full and
    sliding layers alternate (what transformers' models with mixed layers accept).

    Full layers: :func:`medusa_lite.tree.attention_bias` (every node sees the whole cache and its
    ancestors). Sliding layers: :func:`medusa_lite.tree.sliding_attention_bias` over the keys the layer
    still holds (its ``get_mask_sizes``). A cache without sliding layers takes the full mask alone.
    The first call turns the sliding layers' past recording on (the verify pass appends a whole tree).
    """
    sliding = cache.is_sliding
    if not any(sliding):
        return attention_bias(buffers, cache_len, dtype)
    n = buffers.num_nodes
    layer = sliding.index(True)
    if not cache.is_recording_past(layer):
        # from the first verify pass on (the prefill has already trimmed the layers to their window),
        # sliding layers keep the tree's keys until keep_accepted crops them
        cache.activate_past_recording()
    kv_length, kv_offset = cache.get_mask_sizes(n, layer)
    if kv_offset + kv_length - n != cache_len:
        raise RuntimeError(f"sliding layer {layer} holds positions up to {kv_offset + kv_length - n}, "
                           f"the tree starts at {cache_len}")
    window = int(cache.layers[layer].sliding_window)
    masks = {SLIDING: sliding_attention_bias(buffers, cache_len, dtype, window, kv_offset)}
    if all(sliding):
        return masks[SLIDING]
    masks[FULL] = attention_bias(buffers, cache_len, dtype)
    return masks


def keep_accepted(cache: DynamicCache, prefix_len: int, accepted: torch.Tensor) -> None:
    """Keep cache positions ``[0, prefix_len)`` plus ``prefix_len + accepted``; drop every other tree node.

    accepted: [a] long node indices in increasing order (root first). Only the accepted entries move:
    they are copied in place right after the prefix and the tensors are narrowed (a view). A
    sliding-window layer holds only the last keys of the prefix: its tree starts where those end, and
    ``crop`` then trims it back to ``window - 1`` keys.
    """
    a = accepted.numel()
    contiguous = bool(accepted[-1] == a - 1)  # accepted nodes 0..a-1 already sit where they belong
    for layer in cache.layers:
        if layer.is_sliding:
            tree = layer.get_seq_length() - prefix_len  # nodes appended by the verify pass
            start = layer.keys.shape[-2] - tree  # where the tree starts in what the layer holds
            if not contiguous:
                src = accepted + start
                layer.keys[:, :, start:start + a] = layer.keys.index_select(2, src)
                layer.values[:, :, start:start + a] = layer.values.index_select(2, src)
            layer.crop(a - tree)  # drop the other nodes; back to window - 1 keys
            continue
        if not contiguous:
            src = accepted + prefix_len  # [a]
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
    if any(cache.is_recording_past(i) for i in range(len(cache.layers))):
        cache.crop(0)  # sliding layers back to their window


# ---------------------------------------------------------------------------- many rows in one cache
# A batch of sequences shares one DynamicCache of full-attention layers, [B, H, S, D] per layer, with a
# ``valid`` mask [B, S]: the slots each row attends to. A row's other slots are holes (left padding when
# rows of different lengths join, tree nodes another row accepted and this one did not). Keys are stored
# after RoPE at each row's own positions, so where a slot sits physically does not matter: holes are
# masked, and compacting (moving slots) changes nothing a row sees.

def check_batchable(cache: DynamicCache) -> None:
    """Raise :class:`UnsupportedCacheError` unless every layer is full attention (sliding layers keep only their
    window and cannot hold holes: such models decode one row at a time)."""
    if any(cache.is_sliding):
        raise UnsupportedCacheError("batched verification needs full-attention layers only: this model has "
                                    "sliding-window layers, which decode one sequence at a time")


def _pad_slots(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, n + S, D], n zero slots in front."""
    return torch.nn.functional.pad(x, (0, 0, n, 0)) if n else x


def join_rows(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor) -> torch.Tensor:
    """Append ``other``'s rows to ``cache`` (in place): the shorter side is left-padded with holes.
    valid: [B, S], other_valid: [B', S'] -> [B + B', max(S, S')]."""
    s, t = valid.shape[1], other_valid.shape[1]
    length = max(s, t)
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([_pad_slots(mine.keys, length - s), _pad_slots(theirs.keys, length - t)])
        mine.values = torch.cat([_pad_slots(mine.values, length - s), _pad_slots(theirs.values, length - t)])
    pad = torch.nn.functional.pad
    return torch.cat([pad(valid, (length - s, 0)), pad(other_valid, (length - t, 0))])


def select_rows(cache: DynamicCache, valid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep only ``rows`` ([B'] long) of the cache (in place); returns their valid mask [B', S]."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
    return valid.index_select(0, rows)


def keep_accepted_rows(cache: DynamicCache, prefix_len: int, accepted: list[torch.Tensor]) -> torch.Tensor:
    """Batched :func:`keep_accepted`: row b keeps slots ``[0, prefix_len)`` and its accepted nodes, moved to the
    front of the step's block; the block is cut to the longest row's A nodes.

    accepted: per row [a_b] long node indices, increasing (root first). Returns [B, A] bool: which of the A new
    slots each row holds (the others are holes)."""
    lengths = [int(a.numel()) for a in accepted]
    width = max(lengths)
    device = cache.layers[0].keys.device
    if any(int(a[-1]) != n - 1 for a, n in zip(accepted, lengths)):  # some row accepted a non-first branch
        index = torch.stack([torch.nn.functional.pad(a, (0, width - n), value=int(a[-1]))
                             for a, n in zip(accepted, lengths)]).to(device)  # [B, A]
        for layer in cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)
                block = x[:, :, prefix_len:]                                          # [B, H, N, D]
                gather = index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])  # [B, H, A, D]
                x[:, :, prefix_len:prefix_len + width] = block.gather(2, gather)
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :prefix_len + width]
        layer.values = layer.values[:, :, :prefix_len + width]
    return torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]


def compact_rows(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Close the holes (in place): every row's held slots move to the end, in order, and the columns no row needs
    are dropped. valid: [B, S] -> [B, S'] with S' the longest row's held slots."""
    held = int(valid.sum(dim=1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, valid.shape[1] - held:]  # [B, S']
    for layer in cache.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)
            setattr(layer, name, x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])))
    return valid.gather(1, order)


def batch_attention_mask(valid: torch.Tensor, trees: list[TreeBuffers], nodes: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a verify pass over B rows' trees, padded to ``nodes`` tokens: [B, 1, nodes, S + nodes].

    Row b's nodes see the cache slots ``valid[b]`` ([B, S] bool) marks and their own ancestors (its tree's
    ``ancestor_mask``); padding nodes past its tree see the cache and themselves only, and are never accepted."""
    batch, slots = valid.shape
    allowed = torch.zeros(batch, nodes, slots + nodes, dtype=torch.bool, device=valid.device)
    allowed[:, :, :slots] = valid[:, None, :]
    allowed[:, :, slots:] = torch.eye(nodes, dtype=torch.bool, device=valid.device)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        allowed[b, :n, slots:slots + n] = tree.ancestor_mask
    bias = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
