"""The target's attention inside medusa_lite's forwards, through transformers' public ``AttentionInterface``.

transformers looks up each attention layer's function by the name in the model's config (``sdpa`` by default).
medusa_lite adds one name, :data:`NAME`, on first use (it never replaces an entry: other models and every name
transformers has stay as they are). :func:`routed` points one CPU target at that name while its block runs (a
decoding loop) and puts ``sdpa`` back afterwards. The function is transformers' SDPA except inside :func:`attending`
(a forward of medusa_lite's decoding, on the thread that entered it), where two CPU choices differ:

* Grouped key/value heads are used as they are. With an attention mask (every tree and batched forward has one),
  transformers' SDPA repeats each key/value head once per query head it serves (``repeat_kv``), which copies the
  whole cache in every layer of every step. torch's SDPA on CPU takes the grouped heads directly (``enable_gqa``)
  and gives the same bits (``tests/test_batch.py``). One query token per row in bf16 / fp16 packs the query heads
  of a key/value head as that many query positions instead (transformers' ``pack_gqa``, which it uses itself for
  a masked single query): several times faster than torch's CPU kernel for one half-precision query, and the same
  bits at most cache lengths (the two kernels round differently at a few). fp32 keeps torch's GQA kernel.
* With ``small``, the few-query kernel (:func:`medusa_lite.kernels.attention_kernel`, ``csrc/small_attention.cpp``)
  takes a call of at most :data:`SMALL_ATTENTION_QUERIES` queries per row (the root alone, a batched step's roots,
  small trees): the queries that share a key/value head read each cached key and value once, with fp32 sums, so
  results differ from SDPA's only by float rounding (docs/hardware.md).

A target whose layers do not look their function up by name (they do not switch, as transformers reports) and any
non-CPU target keep transformers' own attention. The model's attention setting is the target's own state: while one
thread holds a target routed, another thread's forwards of that target go through this function too, and get
transformers' SDPA from it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

NAME = "medusa_lite"  # no "sdpa", "flash" or "flex" inside: transformers treats names holding those specially
SMALL_ATTENTION_QUERIES = 6  # queries per row up to which the few-query kernel beats torch's SDPA (fp32 and bf16)
_SDPA_EXTRAS = ("softcap", "position_bias", "s_aux", "sinks")  # arguments only transformers' own SDPA handles
_FORWARD = threading.local()  # .state: (single_query, small kernel) while a forward of medusa_lite's runs here
_SWITCHES: dict[type, bool] = {}  # per model class: whether its attention took NAME (asked once: transformers warns)


def _sdpa():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def _register() -> None:
    """Add :data:`NAME` to transformers' attention functions and attention masks (SDPA's masks), once."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, _attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _switch(target) -> bool:
    """Point ``target``'s attention at :data:`NAME`; False where its class cannot switch (asked once per class)."""
    kind = type(target)
    if _SWITCHES.get(kind, True):
        _register()
        try:
            target.set_attn_implementation(NAME)
        except (ValueError, ImportError, KeyError):  # a check of transformers' refused it: decode as the model is
            target.set_attn_implementation("sdpa")
        _SWITCHES[kind] = target.config._attn_implementation == NAME
    return _SWITCHES[kind]


@contextlib.contextmanager
def routed(target):
    """``target``'s attention layers call :data:`NAME`'s function for the block where they call transformers'
    ``sdpa`` now (a CPU target whose layers switch); ``sdpa`` again afterwards. An inner block (already routed)
    changes nothing: switching walks every module (~1 ms), so a decoding loop routes once and its forwards do not."""
    config = getattr(target, "config", None)
    switched = (getattr(config, "_attn_implementation", None) == "sdpa" and target.device.type == "cpu"
                and _switch(target))
    try:
        yield
    finally:
        if switched:
            target.set_attn_implementation("sdpa")


@contextlib.contextmanager
def attending(target, single_query: bool = False, small=None):
    """``target``'s forwards inside this block, on this thread, attend with the grouped heads as they are and, with
    ``small`` (the few-query kernel; None: SDPA alone), through it where a call fits (see the module's docstring).
    ``single_query``: the forward has one query token and passes no mask (a mask tells it otherwise)."""
    with routed(target):
        before = getattr(_FORWARD, "state", None)
        _FORWARD.state = (single_query, small)
        try:
            yield
        finally:
            _FORWARD.state = before


def takes_grouped_heads(mask, key: torch.Tensor, single_query: bool = False) -> bool:
    """Inside :func:`attending`: True when torch's GQA kernel takes the grouped heads (``enable_gqa``), False when a
    single half-precision query's heads are packed as query positions (``single_query``: the forward's flag, read
    off the mask where there is one)."""
    single = single_query if mask is None else mask.shape[-2] == 1
    return not (single and key.dtype in (torch.bfloat16, torch.float16))


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """:data:`NAME`'s function: [B, H, L, D] queries -> ([B, L, H, D] output, None), as transformers' SDPA returns
    it. Transformers' SDPA itself outside :func:`attending` and wherever the choices above do not apply."""
    state = getattr(_FORWARD, "state", None)
    if state is not None and query.device.type == "cpu" and all(kwargs.get(n) is None for n in _SDPA_EXTRAS):
        single_query, small = state
        if small is not None and dropout == 0.0 and _small_fits(query, key, value, attention_mask):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = small.small_attention(query, key, value, attention_mask, scale)  # [B, H, L, D]
            return out.transpose(1, 2).contiguous(), None
        if getattr(module, "num_key_value_groups", 1) > 1 and key.shape[-1] == value.shape[-1]:
            if takes_grouped_heads(attention_mask, key, single_query):
                return _grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal), None
            if attention_mask is None and query.shape[2] == 1:  # (a mask: transformers packs the query itself)
                return _grouped_sdpa(module, query, key, value, None, dropout, scaling, is_causal, pack=True), None
    return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                   **kwargs)


def _grouped_sdpa(module, query, key, value, mask, dropout, scaling, is_causal, pack: bool = False) -> torch.Tensor:
    """transformers' SDPA call (its causal flag, its cut of an empty static cache's keys, its output layout) on the
    grouped key/value heads: torch's GQA kernel, or with ``pack`` one query's heads as [B, H_kv, groups, D]."""
    q_length = query.shape[2]
    if pack:
        query = query.reshape(query.shape[0], -1, module.num_key_value_groups, query.shape[-1])
    causal = q_length > 1 and mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal",
                                                                                                 True))
    if causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, is_causal=causal, enable_gqa=not pack)
    return out.reshape(out.shape[0], -1, q_length, value.shape[-1]).transpose(1, 2).contiguous()


def _small_fits(query, key, value, mask) -> bool:
    """Whether the few-query kernel computes this attention call as SDPA would: CPU, fp32 / bf16, a few queries, grouped
    heads with a contiguous head dimension, an additive [B, 1, L, S] mask (or none for one query)."""
    batch, heads, queries, dim = query.shape
    if (query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype
            or value.dtype != query.dtype or queries > SMALL_ATTENTION_QUERIES or dim % 8 or dim > 256
            or key.shape != value.shape
            or key.stride() != value.stride() or key.stride(-1) != 1 or key.shape[0] != batch or key.shape[-1] != dim
            or heads % key.shape[1]):
        return False
    if mask is None:
        return queries == 1  # one query sees every key; more would need the causal flag
    return (mask.dim() == 4 and mask.is_floating_point() and mask.shape[1] == 1 and mask.shape[2] == queries
            and mask.shape[3] == key.shape[2] and mask.shape[0] in (1, batch))
