"""A row's grammar in the speculative loop (:mod:`medusa_lite.constraints`): before the verify forward its drafted tree
loses the nodes whose path the grammar forbids and gains the tokens the grammar forces after the root; after it, the
walks ask the grammar for the mask of each node they visit (the root, then each accepted child).

A forbidden *sampled* child (its token drawn from a proposal q, :class:`~medusa_lite.verify.Proposals`) is not verified
but still takes its turn among its siblings in a sampling walk: it is rejected there for certain (the target gives its
token probability 0) and the residual becomes norm(max(r - q, 0)), as for any rejected draw. Skipping its turn instead
would leave r unchanged only when the draw happened to be forbidden, and the later siblings' draws would then be
verified against the wrong residual. Forbidden one-hot children simply go (rejecting one leaves r unchanged)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constraints import GrammarState, masked
from ..drafters import Draft
from ..sampling import target_probs
from ..tree import buffers_from_parents, merge_chain
from ..verify import Proposals, greedy_walk, sample_walk


@dataclass
class WalkTree:
    """The tree a sampling walk tries: the verified nodes and, as leaves, the forbidden sampled children (see the
    module). ``verified[i]``: walk node i's index in the verified draft, -1 for a forbidden leaf."""

    tokens: torch.Tensor            # [W] long
    parents: list[int]              # [W], parents first
    proposals: Proposals | None
    verified: list[int]             # [W]


def constrain(draft: Draft, grammar: GrammarState, max_depth: int) -> tuple[Draft, WalkTree | None]:
    """The draft a constrained row verifies: the nodes whose path the grammar allows, plus the forced tokens (at most
    ``max_depth``) merged under the root; and the sampling walk's tree when it differs (forbidden sampled leaves).
    Decided from the drafted tokens and the grammar only, never from this step's draws: exact."""
    tokens, parents = draft.tokens.tolist(), draft.buffers.parents
    valid = grammar.valid_nodes(tokens, parents)
    chain = grammar.forced(max_depth)
    proposals = draft.proposals
    rows = proposals.row.tolist() if proposals is not None else []
    sampled = [i < len(rows) and rows[i] >= 0 for i in range(len(tokens))]
    walk = [i for i in range(len(tokens)) if valid[i] or (sampled[i] and valid[parents[i]])]
    if all(valid) and not chain:
        return draft, None
    index = {old: new for new, old in enumerate(walk)}
    w_parents, w_tokens = merge_chain([-1] + [index[parents[i]] for i in walk[1:]], [tokens[i] for i in walk], chain)
    source = walk + [-1] * (len(w_tokens) - len(walk))  # original node of each walk node, -1: a forced token
    kept = [k for k, old in enumerate(source) if old < 0 or valid[old]]
    verified = [-1] * len(w_tokens)
    for new, k in enumerate(kept):
        verified[k] = new
    device = draft.tokens.device
    v_parents = [-1] + [verified[w_parents[k]] for k in kept[1:]]
    result = Draft(torch.tensor([w_tokens[k] for k in kept], dtype=torch.long, device=device),
                   buffers_from_parents(v_parents, device), _select(proposals, [source[k] for k in kept]))
    if len(kept) == len(w_tokens):
        return result, None
    return result, WalkTree(torch.tensor(w_tokens, dtype=torch.long, device=device), w_parents,
                            _select(proposals, source), verified)


def _select(proposals: Proposals | None, nodes: list[int]) -> Proposals | None:
    """The proposals of ``nodes`` (original node indices; -1 or beyond the drafted rows: a one-hot proposal)."""
    if proposals is None:
        return None
    row, rank = proposals.row.tolist(), proposals.rank.tolist()
    pick = [(row[i], rank[i]) if 0 <= i < len(row) else (-1, 0) for i in nodes]
    device = proposals.row.device
    return Proposals(proposals.probs, proposals.drawn, torch.tensor([r for r, _ in pick], device=device),
                     torch.tensor([k for _, k in pick], device=device), proposals.vocab)


def constrained_accept(grammar: GrammarState, output: list[int], draft: Draft, walk: WalkTree | None,
                       scores: torch.Tensor, warpers, generator: torch.Generator | None,
                       sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A constrained row's acceptance: scores [N, V] at the draft's nodes (processed: penalties, token masks), each
    visited node's masked by the grammar after ``output`` (the row's output, ending in the root) and its path.
    Greedy: the masked argmax, as plain constrained decoding. Sampling: the masked scores through ``warpers``.
    Returns (accepted nodes of the draft [a+1] long, root first; bonus token [] long)."""
    if not sample:
        allowed = grammar.at(output, draft.tokens.tolist(), draft.buffers.parents)
        return greedy_walk(draft.tokens, draft.buffers.parents,
                           lambda node: int(masked(scores[node: node + 1], allowed(node)).argmax()))
    if walk is None:
        walk = WalkTree(draft.tokens, draft.buffers.parents, draft.proposals, list(range(draft.tokens.numel())))
    allowed = grammar.at(output, walk.tokens.tolist(), walk.parents)

    def target(node: int) -> torch.Tensor:  # only verified nodes are visited: a forbidden leaf is never accepted
        row = walk.verified[node]
        return target_probs(masked(scores[row: row + 1], allowed(node)), warpers)[0].double()

    nodes, bonus = sample_walk(walk.tokens, walk.parents, target, walk.proposals, generator)
    return torch.tensor([walk.verified[n] for n in nodes.tolist()], device=nodes.device), bonus
