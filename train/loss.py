"""Medusa training loss and agreement metrics: pure functions, tensors in, tensors out.

Head k (0-based) at position t predicts the token at t + 2 + k. Its self-distillation teacher is the
target's own distribution for that token: the target logits at position t + 1 + k, which the target
forward over the same window has already computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def num_positions(seq_len: int, num_heads: int) -> int:
    """Positions per window that every head trains on (the window's last num_heads + 1 only teach)."""
    return seq_len - num_heads - 1


def medusa_loss(
    head_logits: torch.Tensor,        # [K, B, T, V] draft logits at every window position
    teacher_logits: torch.Tensor,     # [B, T, V] target logits at the same positions (no grad)
    weights: torch.Tensor,            # [K, B, T] 1 where head k at t is trained
    input_ids: torch.Tensor | None = None,  # [B, T] data tokens (for loss="ce")
    *,
    loss: str = "kl",
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum over heads of ``decay**k * mean_t loss_k(t)`` and per-head statistics.

    ``loss="kl"``: ``KL(p_target(. | x<=t+1+k) || q_k(. | h_t))``; ``loss="ce"``: cross-entropy to the
    data token ``x_{t+2+k}``. Returns (scalar loss, {"loss": [K], "top1": [K], "count": [K]}) where
    ``top1`` is the weighted number of positions whose head argmax equals the target argmax.
    """
    num_heads, _, seq_len, _ = head_logits.shape
    n = num_positions(seq_len, num_heads)
    if loss not in ("kl", "ce"):
        raise ValueError(f"loss must be 'kl' or 'ce', got {loss!r}")
    if loss == "ce" and input_ids is None:
        raise ValueError("loss='ce' needs input_ids")
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1)   # [B, T, V]
        teacher_top1 = teacher_logits.argmax(dim=-1)                    # [B, T]
    total = head_logits.new_zeros((), dtype=torch.float32)
    losses, top1, counts = [], [], []
    for k in range(num_heads):
        w = weights[k, :, :n].to(torch.float32)                         # [B, n]
        logq = F.log_softmax(head_logits[k, :, :n].float(), dim=-1)     # [B, n, V]
        if loss == "kl":
            logp = teacher_logp[:, 1 + k: 1 + k + n]                   # [B, n, V]
            per_token = (logp.exp() * (logp - logq)).sum(-1)           # [B, n]
        else:
            target = input_ids[:, 2 + k: 2 + k + n]                     # [B, n]
            per_token = -logq.gather(-1, target[..., None])[..., 0]
        count = w.sum()
        loss_k = (per_token * w).sum() / count.clamp(min=1)
        total = total + decay ** k * loss_k
        with torch.no_grad():
            hit = (logq.argmax(-1) == teacher_top1[:, 1 + k: 1 + k + n]).float()
        losses.append(loss_k.detach())
        top1.append((hit * w).sum())
        counts.append(count)
    return total, {"loss": torch.stack(losses), "top1": torch.stack(top1), "count": torch.stack(counts)}


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
