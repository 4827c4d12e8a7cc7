"""Small facts about Hugging Face models and torch dtypes that several layers need (a leaf: imports no project module)."""

from __future__ import annotations

import inspect

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
