"""Medusa draft heads: [B, T, H] final-norm hidden states -> K next-next-token logits. Torch only."""

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

    def hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [K, B, T, H] per-head features before the vocabulary projection."""
        return torch.stack([block(hidden_states) for block in self.blocks])

    def forward(self, hidden_states: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """hidden_states: [B, T, H] -> logits [K, B, T, V]."""
        feats = self.hidden(hidden_states)  # [K, B, T, H]
        if self.lm_heads is None:
            return base_lm_head(feats)
        return torch.stack([lm_head(f) for lm_head, f in zip(self.lm_heads, feats)])
