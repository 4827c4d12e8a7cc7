"""The KV cache: the only package touching transformers' cache internals. :mod:`.cache` (supported layers, checks,
keep the accepted path), :mod:`.masks` (verify masks, full / sliding / batched), :mod:`.rows` (many rows in one cache:
join, select, keep, compact)."""

from .cache import (CHUNKED, FULL, SLIDING, SUPPORTED_LAYERS, AttentionLayout, UnsupportedCacheError, attention_layout,
                    check_cache, check_model, extend_cache, keep_accepted, layer_types, new_cache, rows_cache)
from .masks import batch_attention_mask, tree_attention_mask
from .rows import compact_rows, join_rows, keep_accepted_rows, select_rows

__all__ = ["AttentionLayout", "CHUNKED", "FULL", "SLIDING", "SUPPORTED_LAYERS", "UnsupportedCacheError", "attention_layout",
           "batch_attention_mask", "check_cache", "check_model", "compact_rows", "extend_cache", "join_rows", "keep_accepted", "keep_accepted_rows",
           "layer_types", "new_cache", "rows_cache", "select_rows", "tree_attention_mask"]
