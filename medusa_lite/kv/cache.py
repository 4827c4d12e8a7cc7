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

Chunked attention (Llama 4: a token sees the earlier tokens of its own chunk of ``w`` positions) keeps a window of
``w`` keys in the same layer class, and is run the same way with a mask counted by chunks.

Recurrent, linear-attention, convolutional and hybrid layers are refused when the model is
wrapped (:func:`check_model`, called by ``MedusaModel(...)``), with an error naming the layer type:
their state after a tree of tokens mixes siblings, and cannot be rolled back to one path. So are ALiBi
models (Bloom, MPT, Falcon with ``alibi``): transformers builds their bias from a 2-D mask, which cannot
describe a tree.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .._hf import text_config

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


class SlackLayer(DynamicLayer):
    """A full-attention ``DynamicLayer`` whose keys and values live in buffers with spare room, so appending a step's
    tokens writes them in place instead of copying the whole layer (``torch.cat`` into a fresh tensor: on a CPU the
    copy and the page faults of a new allocation cost ~9 ms a layer for 8 rows of 800 tokens, more than the step's
    attention). ``keys`` / ``values`` are the held part, ``[B, H, S, D]`` views of the buffers; assigning a view that
    starts the buffer (narrowing, as :func:`keep_accepted` does) keeps the room, any other tensor becomes the buffer."""

    def __init__(self, **kwargs):
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._held = {"keys": 0, "values": 0}
        super().__init__(**kwargs)

    def _get(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        return buffer if buffer is None else buffer[:, :, : self._held[name]]

    def _set(self, name: str, value: torch.Tensor | None) -> None:
        buffer = self._buffers[name]
        if (value is not None and buffer is not None and value.dim() == 4 and value.data_ptr() == buffer.data_ptr()
                and value.stride() == buffer.stride() and value.shape[:2] == buffer.shape[:2]
                and value.shape[3] == buffer.shape[3] and value.shape[2] <= buffer.shape[2]):
            self._held[name] = value.shape[2]  # a prefix of the buffer: keep the room after it
            return
        self._buffers[name] = value
        self._held[name] = value.shape[2] if value is not None and value.dim() == 4 else 0

    keys = property(lambda self: self._get("keys"), lambda self, v: self._set("keys", v))
    values = property(lambda self: self._get("values"), lambda self, v: self._set("values", v))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values

    def _append(self, name: str, new: torch.Tensor) -> None:
        """[B, H, S, D] held + new [B, H, N, D] -> [B, H, S + N, D] held, written into the room (grown by a quarter
        and 128 slots when it runs out)."""
        buffer, held = self._buffers[name], self._held[name]
        need = held + new.shape[2]
        if buffer is None or buffer.shape[2] < need or buffer.shape[:2] != new.shape[:2] or buffer.dtype != new.dtype:
            grown = new.new_empty(new.shape[0], new.shape[1], need + need // 4 + 128, new.shape[3])
            if held:
                grown[:, :, :held] = buffer[:, :, :held]
            buffer = self._buffers[name] = grown
        buffer[:, :, held:need] = new
        self._held[name] = need


# cache layer class -> the layer types (the keys of transformers' per-type mask mapping) it serves: a chunked layer
# (Llama 4) keeps a window of its chunk's size, like a sliding one; its mask counts the window by chunks
SUPPORTED_LAYERS = {DynamicLayer: (FULL,), SlackLayer: (FULL,), DynamicSlidingWindowLayer: (SLIDING, CHUNKED)}
_WHY = {
    "linear_attention": "a recurrent / state-space (Mamba-style) or linear-attention state",
    "conv": "a causal-convolution state",
    "hybrid": "a recurrent state next to its attention cache",
    "hybrid_sliding": "a recurrent state next to its attention cache",
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
    config = text_config(model.config)
    if uses_alibi(config):
        raise UnsupportedCacheError(
            f"{type(model).__name__} adds ALiBi position biases, which transformers builds from a 2-D attention "
            "mask (each key's offset counted along the sequence): a tree of drafted tokens needs a 4-D mask in "
            "which a node's offset is its depth, so medusa_lite refuses this model rather than change its output")
    check_cache(DynamicCache(config=config), layer_types(model))


def uses_alibi(config) -> bool:
    """Bloom, MPT, and Falcon with ``alibi=True``: attention biased by ALiBi built from the 2-D mask."""
    attn = getattr(config, "attn_config", None)
    return (config.model_type == "bloom" or bool(getattr(config, "alibi", False))
            or bool(getattr(attn, "alibi", False)))


def new_cache(model) -> DynamicCache:
    """A fresh ``DynamicCache`` for ``model`` (full-attention layers as :class:`SlackLayer`); refuses models with
    layers tree verification cannot rewind."""
    cache = DynamicCache(config=text_config(model.config))
    check_cache(cache)
    cache.layers = [SlackLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def check_cache(cache, types: list[str] | None = None) -> None:
    """Raise :class:`UnsupportedCacheError` unless every layer is a full-attention ``DynamicLayer`` or a
    ``DynamicSlidingWindowLayer`` of sliding or chunked attention, all of these of one kind and one window."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"medusa_lite needs a DynamicCache, the model uses {type(cache).__name__}")
    windows, kinds = set(), set()
    for i, layer in enumerate(cache.layers):
        kind = types[i] if types is not None and i < len(types) else None
        if type(layer) not in SUPPORTED_LAYERS or (kind is not None and kind not in SUPPORTED_LAYERS[type(layer)]):
            why = _WHY.get(kind, "a cache layer other than full or sliding-window attention")
            raise UnsupportedCacheError(
                f"cache layer {i} is {kind or 'of type'} {type(layer).__name__!r}: {why}. Tree verification "
                "feeds every drafted branch through the layer at once and then keeps one path, which this "
                "layer's state cannot be rolled back to exactly, so medusa_lite refuses this model rather "
                "than change its output")
        if layer.is_sliding:
            windows.add(int(layer.sliding_window))
            kinds.add(kind)
    if len(windows) > 1 or len(kinds - {None}) > 1:
        raise UnsupportedCacheError(f"windowed layers of different windows {sorted(windows)} or kinds "
                                    f"{sorted(k for k in kinds if k)}: transformers takes one mask per layer type")


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
# A batch of sequences shares one DynamicCache, [B, H, S, D] per layer, with a ``valid`` mask [B, S]: the slots each
# row attends to. A row's other slots are holes (left padding when rows of different lengths join, tree nodes
# another row accepted and this one did not). Keys are stored after RoPE at each row's own positions, so where a
# slot sits physically does not matter: holes are masked, and compacting (moving slots) changes nothing a row sees.
# A row's held slots stay in the order of its positions, so slot s of row b holds position ``valid[b, :s].sum()``.

def rows_cache(model) -> DynamicCache:
    """A fresh cache for rows that share verify steps: every layer keeps every key (``DynamicLayer``). A sliding-window
    layer cannot trim a cache with holes to each row's window, so in a batch it holds the whole context and the
    window is cut by the mask (:func:`medusa_lite.kv.batch_attention_mask`); a model without sliding layers gets
    the same cache as :func:`new_cache`."""
    cache = new_cache(model)
    cache.layers = [layer if not layer.is_sliding else SlackLayer() for layer in cache.layers]
    return cache


@dataclass(frozen=True)
class AttentionLayout:
    """How a model's windowed layers count their window: the masks a verify pass builds for it."""

    window: int | None = None   # the window of its sliding or chunked layers (one for all); None: full attention only
    kind: str = SLIDING         # SLIDING (the last ``window`` positions) or CHUNKED (the positions of one's chunk)
    full_layers: bool = True    # whether full-attention layers are there too (then masks go per layer type)


def attention_layout(model) -> AttentionLayout:
    """The :class:`AttentionLayout` of ``model`` (its cache layers and layer types)."""
    cache = new_cache(model)
    window = next((int(layer.sliding_window) for layer in cache.layers if layer.is_sliding), None)
    types = layer_types(model)
    return AttentionLayout(window, CHUNKED if CHUNKED in types else SLIDING, not all(cache.is_sliding))
