"""Small facts about Hugging Face models and torch dtypes that several layers need (a leaf: imports no project module)."""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def output_weight(target) -> torch.Tensor:
    """The target's output embedding (``lm_head``) weight: its device and dtype are where and in what the model
    computes."""
    return target.get_output_embeddings().weight


def text_config(config):
    """The decoder's config (multimodal configs nest it; plain LM configs are their own)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def context_length(config) -> int | None:
    """The target's maximum number of positions, if its config states one."""
    config = text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cache_kwarg(target) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; older models ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def prefill_kwargs(target) -> dict:
    """``logits_to_keep=1`` for prefill where the target supports it (saves a [L, V] logits tensor)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


def dtype_name(dtype) -> str:
    """torch.bfloat16 / 'bfloat16' / 'bf16' -> 'bfloat16' (the key of ``MedusaConfig.dtype_trees``)."""
    name = str(dtype).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(name, name)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'fp32' / 'bf16' / 'fp16' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# ------------------------------------------------------------------------- grouped-query attention without copies
_GROUPED = threading.local()


def _install_grouped_attention() -> bool:
    """Wrap transformers' SDPA choice of grouped-query attention once (idempotent): inside :func:`grouped_attention`
    on this thread, CPU tensors take torch's own GQA, or transformers' packing of a single query's heads in half
    precision; everywhere else the choice is transformers' as before."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return False
    choose = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if choose is None or not hasattr(sdpa_attention, "pack_gqa"):
        return False
    if not getattr(choose, "_medusa_lite", False):
        def use_gqa_in_sdpa(attention_mask, key, value):
            if getattr(_GROUPED, "active", False) and key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
                single = _GROUPED.single if attention_mask is None else attention_mask.shape[-2] == 1
                return not (single and key.dtype in (torch.bfloat16, torch.float16))
            return choose(attention_mask, key, value)

        use_gqa_in_sdpa._medusa_lite = True
        sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True


SMALL_ATTENTION_QUERIES = 6  # queries per row up to which the few-query kernel beats torch's SDPA (fp32 and bf16)


def _install_small_attention() -> bool:
    """Wrap transformers' ``sdpa`` attention function once (idempotent): inside :func:`grouped_attention` on this thread,
    a CPU forward of at most :data:`SMALL_ATTENTION_QUERIES` queries per row takes the few-query kernel
    (:func:`medusa_lite.kernels.attention_kernel`); every other call is transformers' own."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    sdpa = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if sdpa is None:
        return False
    if getattr(sdpa, "_medusa_lite", False):
        return True

    def sdpa_or_small(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        kernel = getattr(_GROUPED, "small", None)
        if kernel is not None and dropout == 0.0 and _small_fits(query, key, value, attention_mask, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = kernel.small_attention(query, key, value, attention_mask, scale)  # [B, H, L, D]
            return out.transpose(1, 2).contiguous(), None
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)

    sdpa_or_small._medusa_lite = True
    ALL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_or_small)
    return True


def _small_fits(query, key, value, mask, kwargs) -> bool:
    """Whether the few-query kernel computes this attention call as SDPA would: CPU, fp32 / bf16, a few queries, grouped
    heads with a contiguous head dimension, an additive [B, 1, L, S] mask (or none for one query), nothing else."""
    batch, heads, queries, dim = query.shape
    if (query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype
            or value.dtype != query.dtype or queries > SMALL_ATTENTION_QUERIES or dim % 8 or dim > 256
            or key.shape != value.shape
            or key.stride() != value.stride() or key.stride(-1) != 1 or key.shape[0] != batch or key.shape[-1] != dim
            or heads % key.shape[1]):
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks")):
        return False
    if mask is None:
        return queries == 1  # one query sees every key; more would need the causal flag
    return (mask.dim() == 4 and mask.is_floating_point() and mask.shape[1] == 1 and mask.shape[2] == queries
            and mask.shape[3] == key.shape[2] and mask.shape[0] in (1, batch))


@contextlib.contextmanager
def grouped_attention(single_query: bool = False, small=None):
    """The target's forwards inside this block attend with grouped key/value heads as they are (CPU).

    With an attention mask (every tree and batched forward has one), transformers' SDPA path repeats each key/value
    head once per query head it serves (``repeat_kv``): a copy of the whole cache, 3x its size on the default model,
    in every layer of every step; at 600 cached tokens and a 16-token tree that copy costs as much as the attention.
    torch's SDPA on CPU takes the grouped heads directly (``enable_gqa``) and gives the same result bit for bit
    (``tests/test_batch.py``). One query token per row in bf16 / fp16 (the root alone: ``single_query`` when the
    forward has no mask, else read off the mask) takes transformers' ``pack_gqa`` instead (the query heads of a
    key/value head as that many query positions, what transformers does itself for a masked single query), because
    torch's CPU kernel takes a slow path for one half-precision query; the two give the same bits at most cache
    lengths (they round differently at a few: bf16 rounding). fp32 keeps torch's GQA kernel.

    With ``small``, medusa_lite's few-query attention kernel (:func:`medusa_lite.kernels.attention_kernel`, None where
    it does not build; ``csrc/small_attention.cpp``), a CPU call of at most :data:`SMALL_ATTENTION_QUERIES` queries
    per row (the root alone, a batched step's roots, small trees) takes it instead: the queries sharing a key/value
    head read each cached key and value once (fp32 sums, results differ from SDPA's by float rounding only). From
    about 8 queries a row SDPA is as fast, so longer calls keep it (timings: docs/hardware.md). On other devices,
    and outside this block, nothing changes."""
    if not _install_grouped_attention():
        yield
        return
    small = small if small is not None and _install_small_attention() else None
    before = getattr(_GROUPED, "active", False), getattr(_GROUPED, "single", False), getattr(_GROUPED, "small", None)
    _GROUPED.active, _GROUPED.single, _GROUPED.small = True, single_query, small
    try:
        yield
    finally:
        _GROUPED.active, _GROUPED.single, _GROUPED.small = before
