"""Acceptance rules: tensors in, tensors out.

One target forward over the tree gives, at every node, the target's distribution of the next token
given the path to that node.

* Greedy (:func:`accept`): the target chooses its argmax at every node; a child is accepted when it
  holds the token the target chose at its parent.
* Sampling (:func:`sample_walk`): recursive rejection sampling down the tree. A child whose token was
  drawn from a proposal q (the heads' processed distribution, :class:`Proposals`) is accepted with
  probability min(1, r(x)/q(x)); a deterministic child is a one-hot q (accepted with probability r(x)).
  On rejection r <- norm(max(r - q, 0)); the bonus is drawn from what is left. The output has exactly
  the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def greedy_walk(tokens: torch.Tensor, parents: list[int], choice: Callable[[int], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept` asking for the target's choice only at the nodes it reaches: ``choice(node)``, the root first,
    then each accepted child (for choices that cost something per node, e.g. a grammar's mask). tokens: [N] node
    tokens; parents: [N] (-1 for the root, parents first). Returns (accepted nodes [a+1] long, root first; bonus [])."""
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens.tolist())) if node}
    node, path = 0, [0]
    while True:
        y = choice(node)
        nxt = child.get((node, y))
        if nxt is None:
            return torch.tensor(path, device=tokens.device), torch.tensor(y, device=tokens.device)
        node = nxt
        path.append(node)


@dataclass
class Proposals:
    """Where drafted tokens were *sampled* rather than chosen (sampling mode, :class:`DraftSampler`).

    Node c's token was drawn from row ``row[c]`` of ``probs`` (a distribution over ``vocab`` ids, or
    over the whole vocabulary when ``vocab`` is None) without replacement after that row's earlier draws
    ``drawn[row[c], :rank[c]]``. Nodes with ``row`` -1 (the root, lookup tokens, top-k ranks) hold a
    deterministic token: a one-hot proposal.
    """

    probs: torch.Tensor        # [M, V'] float, one proposal distribution per expanded row
    drawn: torch.Tensor        # [M, k] long, indices into V', in draw order
    row: torch.Tensor          # [N] long, -1: one-hot proposal
    rank: torch.Tensor         # [N] long, draw number within the row
    vocab: torch.Tensor | None = None  # [V'] long token ids, None: V' is the whole vocabulary

    def at(self, node: int, vocab_size: int) -> torch.Tensor | None:
        """Node ``node``'s proposal over the whole vocabulary ([V] float64), None for a one-hot proposal."""
        row = int(self.row[node]) if node < self.row.numel() else -1
        if row < 0:
            return None
        q = self.probs[row].double()
        rank = int(self.rank[node])
        if rank:
            q = q.index_fill(0, self.drawn[row, :rank], 0.0)
        q = q / q.sum()
        if self.vocab is None:
            return q
        return q.new_zeros(vocab_size).index_copy_(0, self.vocab, q)


def sample_walk(tokens: torch.Tensor, parents: list[int], target: Callable[[int], torch.Tensor],
                proposals: Proposals | None = None, generator: torch.Generator | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling verification: walk the tree with recursive rejection sampling (SpecInfer's multi-draft rule).

    tokens: [N] node tokens; parents: [N] parent of every node (-1 for the root, parents first);
    target(node) -> [V] float64, the processed target distribution after node's path (only the nodes
    walked are asked); proposals: which children were sampled and from what (None: all one-hot).

    At a node with target distribution r, children are tried in index order: child c with token x and
    proposal q is accepted with probability min(1, r(x) / q(x)); on rejection r <- norm(max(r - q, 0))
    (for a one-hot q: r without x). Each round is one step of speculative sampling, so whatever is
    accepted, or drawn from the final residual when every child is rejected (the bonus), has exactly
    distribution r; children's drafts never depend on this step's coins, so the walk recurses exactly.
    Returns (accepted nodes [a+1] long, root first; bonus token [] long).
    """
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        r = target(node)  # [V] float64
        for child in children[node]:
            x = toks[child]
            q = proposals.at(child, r.numel()) if proposals is not None else None
            u = float(torch.rand((), dtype=torch.float64, device=r.device, generator=generator))
            rx = float(r[x])
            if u * (1.0 if q is None else float(q[x])) < rx:  # u < min(1, r(x) / q(x))
                node = child
                path.append(child)
                break
            if q is None:
                r = r.clone()
                r[x] = 0.0
            else:
                residual = (r - q).clamp_(min=0.0)
                # rejection implies r != q, so the residual has mass; the guard only catches rounding
                r = residual if float(residual.sum()) > 0 else r
            r = r / r.sum()
        else:
            return torch.tensor(path, device=tokens.device), sample_choice(r[None], generator)[0]
