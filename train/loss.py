"""Held-out agreement of a drafter's teacher-forced logits with the target: a pure function.

Each drafter owns its training loss (``Drafter.loss``; heads: :func:`medusa_lite.drafters.heads.heads_loss`).
"""

from __future__ import annotations

import torch

from medusa_lite.drafters import num_positions


@torch.no_grad()
def agreement(head_logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor,
              topk: tuple[int, ...] = (1, 5), vocab_ids: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Weighted hit counts [K] per k in ``topk``: the target's argmax is among head k's top-k tokens.

    head_logits [K, B, T, V'], teacher_logits [B, T, V], weights [K, B, T] -> {k: [K]}; divide by
    ``weights[:, :, :n].sum((1, 2))`` for rates. ``vocab_ids`` [V'] maps a reduced head vocabulary to
    token ids (V' = V without it).
    """
    num_heads, _, seq_len, _ = head_logits.shape
    n = num_positions(seq_len, num_heads)
    teacher_top1 = teacher_logits.argmax(-1)                            # [B, T]
    out = {k: torch.zeros(num_heads) for k in topk}
    for h in range(num_heads):
        ranked = head_logits[h, :, :n].topk(max(topk), dim=-1).indices  # [B, n, kmax]
        if vocab_ids is not None:
            ranked = vocab_ids.to(ranked.device)[ranked]
        target = teacher_top1[:, 1 + h: 1 + h + n, None]                # [B, n, 1]
        w = weights[h, :, :n].float()
        for k in topk:
            out[k][h] = ((ranked[..., :k] == target).any(-1).float() * w).sum()
    return out


@torch.no_grad()
def sampled_acceptance(head_logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor,
                       vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sums [K] of ``sum_v min(p_v, q_v)``: the chance that rejection sampling at T = 1 accepts head k's
    draw, p the target's distribution of the token, q the head's (shapes as :func:`agreement`)."""
    num_heads, _, seq_len, _ = head_logits.shape
    n = num_positions(seq_len, num_heads)
    p = teacher_logits.float().softmax(-1)                              # [B, T, V]
    if vocab_ids is not None:
        p = p[..., vocab_ids.to(p.device)]                              # [B, T, V'] (q is 0 elsewhere)
    out = torch.zeros(num_heads)
    for h in range(num_heads):
        q = head_logits[h, :, :n].float().softmax(-1)                   # [B, n, V']
        accept = torch.minimum(p[:, 1 + h: 1 + h + n], q).sum(-1)       # [B, n]
        out[h] = (accept * weights[h, :, :n].float()).sum()
    return out
