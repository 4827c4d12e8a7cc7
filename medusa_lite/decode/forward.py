"""The target forwards of the loop, each returning its output and the seconds it took: the prompts' prefill and the
verify forward over one row's tree or over every row's tree at once. The only place the loop calls the target."""

from __future__ import annotations

import time

import torch

from .._hf import prefill_kwargs
from ..kernels import Kernels
from ..kv import AttentionLayout, attention_layout, batch_attention_mask, tree_attention_mask
from ..drafters import Draft, Drafter, drafter_features
from ..tree import TreeBuffers


def prefill(target, prompt: torch.Tensor, cache_arg: dict, kernels: Kernels | None = None):
    """The prompt's forward ([L] long) into the cache of ``cache_arg``: (output, seconds)."""
    t0 = time.perf_counter()
    with (kernels or Kernels()).prefill(target):
        out = target(input_ids=prompt[None], use_cache=True, output_hidden_states=True, return_dict=True,
                     **cache_arg, **prefill_kwargs(target))
    return out, time.perf_counter() - t0


def prefill_rows(target, prompts: list[torch.Tensor], cache_arg: dict, kernels: Kernels | None = None):
    """Several prompts' forward ([L_b] long each) in one, left-padded to the longest, each row at its own positions
    ``0 .. L_b - 1`` (one forward of B x L tokens runs the GEMMs far better than B forwards of L on a CPU):
    (output, valid [B, L] bool: the slots each row holds, seconds). Row b's features are its last L_b positions."""
    width = max(p.numel() for p in prompts)
    pad = torch.nn.functional.pad
    ids = torch.stack([pad(p, (width - p.numel(), 0), value=int(p[0])) for p in prompts])  # [B, L]
    valid = torch.stack([pad(torch.ones_like(p, dtype=torch.bool), (width - p.numel(), 0)) for p in prompts])  # [B, L]
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, L]
    t0 = time.perf_counter()
    with (kernels or Kernels()).prefill(target):
        out = target(input_ids=ids, attention_mask=valid.long(), position_ids=positions, use_cache=True,
                     output_hidden_states=True, return_dict=True, **cache_arg, **prefill_kwargs(target))
    return out, valid, time.perf_counter() - t0


def verify_forward(target, cache_arg: dict, tokens: torch.Tensor, buffers: TreeBuffers, cache_len: int,
                   kernels: Kernels | None = None, layout: AttentionLayout | None = None):
    """One target forward over every tree node: tree attention mask, positions ``cache_len + depth``; (output, seconds).

    tokens: [N] node tokens. The cache grows by N entries (compact it with ``kv.keep_accepted``). Sliding-window
    layers get their own mask (``kv.tree_attention_mask``), by ``layout`` (default: read off the model).
    ``kernels``: the :class:`medusa_lite.kernels.Kernels` it runs with (None: ``Kernels.defaults(target)``).
    """
    dtype = target.get_output_embeddings().weight.dtype
    layout = layout or attention_layout(target)
    t0 = time.perf_counter()
    with (kernels or Kernels.defaults(target)).verify(target, tokens.numel(), single_query=tokens.numel() == 1):
        out = target(input_ids=tokens[None], position_ids=(cache_len + buffers.depths)[None],
                     attention_mask=tree_attention_mask(next(iter(cache_arg.values())), buffers, cache_len, dtype,
                                                        layout),
                     use_cache=True, output_hidden_states=True, return_dict=True, **cache_arg)
    return out, time.perf_counter() - t0


def verify_rows(target, cache_arg: dict, drafts: list[Draft], cache_lens: list[int], valid: torch.Tensor,
                kernels: Kernels | None = None, layout: AttentionLayout | None = None):
    """One target forward over every row's tree (rows padded to the widest): (output, seconds).

    valid: [B, S] the cache slots each row attends to; each row has its own positions ``cache_len + depth``.
    ``layout``: the model's windowed layers (``kv.attention_layout``; None: full attention), masked per row.
    """
    dtype = target.get_output_embeddings().weight.dtype
    t0 = time.perf_counter()
    width = max(d.tokens.numel() for d in drafts)
    pad = torch.nn.functional.pad
    tokens = torch.stack([pad(d.tokens, (0, width - d.tokens.numel())) for d in drafts])  # [B, N]
    positions = torch.stack([n + pad(d.buffers.depths, (0, width - d.tokens.numel()))
                             for n, d in zip(cache_lens, drafts)])  # [B, N] each row's own positions
    mask = batch_attention_mask(valid, [d.buffers for d in drafts], width, dtype, layout or AttentionLayout())
    with (kernels or Kernels.defaults(target)).verify(target, tokens.numel()):
        out = target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                     output_hidden_states=True, return_dict=True, **cache_arg)
    return out, time.perf_counter() - t0


def read_features(out, drafter: Drafter) -> torch.Tensor:
    """The target features the drafter reads: its ``hidden_layers`` concatenated, [B, T, F]."""
    return drafter_features(out.hidden_states, drafter.hidden_layers)
