"""Draft heads: [B, T, H] final-norm hidden states (+ the tokens that follow) -> K future-token logits.

Medusa heads read h_t only. Hydra heads (arXiv:2402.05109) are sequentially dependent: head k also
reads the token at t + 1 + k and the state of head k - 1, so each proposal is conditioned on the path
drafted before it. Both predict the token at t + 2 + k with head k. Torch only."""

from __future__ import annotations

import torch
from torch import nn

from .config import MedusaConfig


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W`` zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # SiLU(0) = 0: an untrained head reproduces the base prediction
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of ``num_layers`` ResBlocks each; head k proposes the token at position t + 2 + k.

    The vocabulary projection is either the frozen target ``lm_head`` shared by all heads (passed to
    :meth:`forward`, never stored here, so it is neither trained nor saved) or a per-head copy
    initialised from it (``config.share_lm_head=False``, created by :meth:`init_lm_heads`).
    """

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        if config.draft_vocab_size is not None:  # token ids the heads may propose, filled by training
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.lm_heads = None
        if not config.share_lm_head:
            self.lm_heads = nn.ModuleList(
                nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads))

    @torch.no_grad()
    def init_lm_heads(self, base_lm_head: nn.Module) -> None:
        """Copy the target's vocabulary projection into every per-head ``lm_head``."""
        if self.lm_heads is not None:
            for lm_head in self.lm_heads:
                lm_head.weight.copy_(base_lm_head.weight)

    def hidden(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
               embed: nn.Module | None = None) -> torch.Tensor:
        """[B, T, H] -> [K, B, T, H] per-head features before the vocabulary projection."""
        return torch.stack([block(hidden_states) for block in self.blocks])

    def forward(self, hidden_states: torch.Tensor, base_lm_head: nn.Module, input_ids: torch.Tensor | None = None,
                embed: nn.Module | None = None) -> torch.Tensor:
        """hidden_states: [B, T, H] (input_ids [B, T] and the target's input embeddings for Hydra heads)
        -> logits [K, B, T, V], head k at t scoring the token at t + 2 + k."""
        feats = self.hidden(hidden_states, input_ids, embed)  # [K, B, T, H]
        if self.lm_heads is None:
            return base_lm_head(feats)
        return torch.stack([lm_head(f) for lm_head, f in zip(self.lm_heads, feats)])


def _unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale the last dimension to unit RMS (token embeddings are far smaller than final-norm states)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class HydraHeads(MedusaHeads):
    """Sequentially dependent heads: ``s_0 = h_t``; ``s_{k+1} = ResBlocks_k(W_k [s_k ; e(x_{t+1+k})])``.

    Head k scores the token at t + 2 + k from ``s_{k+1}``. ``W_k`` starts as ``[I, 0]``, so a fresh
    head reproduces the base prediction as a fresh Medusa head does. ``e`` is the target's (frozen)
    input embedding, passed in like the ``lm_head``.
    """

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fuse = nn.ModuleList(nn.Linear(2 * h, h) for _ in range(config.num_heads))
        with torch.no_grad():
            for linear in self.fuse:
                linear.weight.zero_()
                linear.weight[:, :h].copy_(torch.eye(h))
                linear.bias.zero_()

    def step(self, k: int, state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Head k: state [..., H] and the embedding of the token it follows [..., H] -> new state [..., H]."""
        x = torch.cat([state, _unit_rms(token_embeds).to(state.dtype)], dim=-1)
        return self.blocks[k](self.fuse[k](x))

    def hidden(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
               embed: nn.Module | None = None) -> torch.Tensor:
        """Teacher-forced: head k reads the data token at t + 1 + k (zero past the end)."""
        if input_ids is None or embed is None:
            raise ValueError("Hydra heads need input_ids and the target's input embeddings")
        emb = embed(input_ids)  # [B, T, H]
        state, out = hidden_states, []
        for k in range(self.config.num_heads):
            follow = torch.zeros_like(emb)
            follow[:, : emb.shape[1] - 1 - k] = emb[:, 1 + k:]  # token at t + 1 + k
            state = self.step(k, state, follow)
            out.append(state)
        return torch.stack(out)  # [K, B, T, H]


def build_heads(config: MedusaConfig) -> MedusaHeads:
    return {"medusa": MedusaHeads, "hydra": HydraHeads}[config.head_type](config)
