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


# What transformers' generate() gives a field of the generation config that neither the caller nor the model's
# generation_config sets (GenerationConfig's docstring points to them; transformers exposes no public accessor).
# tests/test_transformers_contract.py holds this table equal to transformers' own.
GENERATION_DEFAULTS = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True, "early_stopping": False, "num_beams": 1,
    "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
    "num_return_sequences": 1, "output_scores": False, "return_dict_in_generate": False,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4, "assistant_lookbehind": 10,
    "target_lookbehind": 10, "num_beam_groups": 1, "diversity_penalty": 0.0,
}


def resolve_generation_config(target, config=None, **kwargs):
    """(config, unused kwargs): the generation config transformers' ``generate`` would run ``target`` with, by its
    rule: a copy of ``config`` (None: a fresh one), its unset fields from the target's ``generation_config`` (which
    also carries the target's custom entries), then :data:`GENERATION_DEFAULTS`, then ``kwargs`` on top; ``unused``:
    the kwargs that name no field, with ``output_attentions`` / ``output_hidden_states`` where the config asks for
    them (transformers hands those to the forward)."""
    import copy

    from transformers import GenerationConfig

    config = copy.deepcopy(config) if config is not None else GenerationConfig()
    config.update(**target.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**GENERATION_DEFAULTS, defaults_only=True)
    unused = config.update(**kwargs)
    if config.cache_implementation == "hybrid":  # (transformers: a default of older sliding-window checkpoints)
        config.cache_implementation = None
    unused.update({name: getattr(config, name) for name in ("output_attentions", "output_hidden_states")
                   if getattr(config, name)})
    return config, unused
