"""Acceptance rules: tensors in, tensors out.

One target forward over the tree gives, at every node, the target's distribution of the next token
given the path to that node. The target *chooses* a token at every node (argmax for greedy, one
draw from the processed distribution for sampling); a child is accepted when it holds the token the
target chose at its parent. Drawing at every node up front is equivalent to drawing lazily along the
walk: the draws are independent and only those on the walked path are ever looked at. For sampling
this is rejection sampling with a one-hot proposal per child (accept child x with probability p(x),
else renormalise p without x), so the output has exactly the target's distribution.
"""

from __future__ import annotations

import torch


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> [N] long, the target's greedy token at every node.

    In float32 as transformers' ``generate`` does (same first-index tie rule; bf16 argmax is also ~5x slower on CPU).
    """
    return logits.float().argmax(dim=-1)


def sample_choice(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs: [N, V] processed target probabilities -> [N] long, one independent draw per node.

    Inverse-CDF sampling in float64 with U in (0, 1]: a zero-probability token is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    u = 1.0 - torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)
    u = u * cdf[:, -1:]  # [N, 1] in (0, total]
    idx = torch.searchsorted(cdf, u, right=False).squeeze(-1)  # first index with cdf >= u
    return idx.clamp_(max=probs.shape[-1] - 1)


def accept(tokens: torch.Tensor, choice: torch.Tensor, paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree: follow the child holding the target's choice at its parent.

    tokens: [N] node tokens; choice: [N] the target's token at every node;
    paths: [P, D+1] node indices root first, padded with -1.
    Returns (accepted nodes [a+1] long, root first; bonus token [] long, the choice at the last accepted
    node). Siblings hold distinct tokens, so the accepted path is unique.
    """
    valid = paths >= 0  # [P, D+1]
    idx = paths.clamp(min=0)
    parent_choice = choice[idx[:, :-1]]  # [P, D]
    match = (tokens[idx[:, 1:]] == parent_choice) & valid[:, 1:]  # [P, D]
    lengths = match.long().cumprod(dim=-1).sum(dim=-1)  # [P]
    best = lengths.argmax()
    a = lengths[best]
    nodes = idx[best, : int(a) + 1]  # one host sync: the accepted length
    return nodes, choice[nodes[-1]]
