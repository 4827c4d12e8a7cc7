"""The attention masks of verify forwards: one row's tree over its cache, with sliding-window layers' own mask
(:func:`tree_attention_mask`), and many rows' trees over a shared cache with holes (:func:`batch_attention_mask`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..tree import TreeBuffers, attention_bias, sliding_attention_bias, within_window
from .cache import CHUNKED, FULL, AttentionLayout

NO_WINDOW = AttentionLayout()


def tree_attention_mask(cache: DynamicCache, buffers: TreeBuffers, cache_len: int, dtype: torch.dtype,
                        layout: AttentionLayout = NO_WINDOW) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The verify pass's attention mask: one 4D additive mask, or ``{layer type: mask}`` when full and
    sliding layers alternate (what transformers' models with mixed layers accept); None for the root alone over a
    cache without sliding layers (one token that sees every cached one: the model's own mask, the forward plain
    decoding runs, whose attention skips the mask: ~0.7 ms less a step for the default model, AVX2 class).

    Full layers: :func:`medusa_lite.tree.attention_bias` (every node sees the whole cache and its
    ancestors). Sliding layers: :func:`medusa_lite.tree.sliding_attention_bias` over the keys the layer
    still holds (its ``get_mask_sizes``), counted by chunks for chunked layers (``layout``, Llama 4). A cache
    without sliding layers takes the full mask alone.
    The first call turns the sliding layers' past recording on (the verify pass appends a whole tree).
    """
    sliding = cache.is_sliding
    if not any(sliding):
        return None if buffers.num_nodes == 1 else attention_bias(buffers, cache_len, dtype)
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
    windowed = sliding_attention_bias(buffers, cache_len, dtype, window, kv_offset, chunked=layout.kind == CHUNKED)
    if all(sliding):
        return windowed
    return {layout.kind: windowed, FULL: attention_bias(buffers, cache_len, dtype)}


def batch_attention_mask(valid: torch.Tensor, trees: list[TreeBuffers], nodes: int, dtype: torch.dtype,
                         layout: AttentionLayout = NO_WINDOW) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask of a verify pass over B rows' trees, padded to ``nodes`` tokens: [B, 1, nodes, S + nodes].

    Row b's nodes see the cache slots ``valid[b]`` ([B, S] bool) marks and their own ancestors (its tree's
    ``ancestor_mask``); padding nodes past its tree see the cache and themselves only, and are never accepted.
    ``layout.window``: the model has sliding-window (or chunked) layers, which in a batch hold every key
    (:func:`~medusa_lite.kv.rows_cache`): their mask also drops the keys outside the node's window, counted from
    the node's own position as :func:`~medusa_lite.tree.sliding_attention_bias` does. Returned alone, or as
    ``{layer type: mask}`` when full layers alternate with them."""
    batch, slots = valid.shape
    allowed = torch.zeros(batch, nodes, slots + nodes, dtype=torch.bool, device=valid.device)
    allowed[:, :, :slots] = valid[:, None, :]
    allowed[:, :, slots:] = torch.eye(nodes, dtype=torch.bool, device=valid.device)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        allowed[b, :n, slots:slots + n] = tree.ancestor_mask
    if layout.window is None:
        return _additive(allowed, dtype)
    depths = torch.stack([torch.nn.functional.pad(t.depths, (0, nodes - t.num_nodes)) for t in trees])  # [B, nodes]
    node_pos = valid.sum(dim=1, keepdim=True) + depths                               # [B, nodes]
    key_pos = torch.cat([valid.cumsum(dim=1) - 1, node_pos], dim=1)                  # [B, S + nodes] (holes: masked)
    near = within_window(node_pos[:, :, None], key_pos[:, None, :], layout.window, layout.kind == CHUNKED)
    windowed = _additive(allowed & near, dtype)                                      # [B, 1, nodes, S + nodes]
    return {FULL: _additive(allowed, dtype), layout.kind: windowed} if layout.full_layers else windowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool -> [B, 1, Q, K] additive mask: 0 where attended, the dtype's minimum elsewhere."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
