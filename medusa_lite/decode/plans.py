"""Plans: which tree the drafter fills at a step. A plan is called with the drafter's state and the deepest depth
allowed and returns one :class:`~medusa_lite.drafters.Draft` per row.

This is all the loop knows about choosing trees. A plan that learns from the steps it planned (the fitted one,
:class:`medusa_lite.decode.adaptive.FittedPlan`) also has ``record(tokens, seconds)``, which the loop calls after each step
verified alone (the *step report*: tokens emitted, wall seconds), and ``report() -> dict``, which ends up in
``GenerationStats.fitted``. Steps that verify several rows together take their tree from a
:class:`BatchPlanner` instead.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Protocol

import torch

from ..drafters import Draft, Drafter, DraftState, per_row
from ..tree import (DynamicTree, TreeBuffers, TreeSpec, WithLookup, buffers_from_parents, build_buffers,
                    lookup_continuation, merge_chain, parse_tree, tree_key, truncate)

# A step's plan: which tree the drafter fills this step. (drafter state, deepest allowed depth: one for all rows or
# one per row) -> one Draft per row. A plan with a ``batch_key`` (not None) drafts every row of a batched step whose
# plan has the same key in one call (the rows' drafting then shares each pass over the drafter's weights).
Plan = Callable[[DraftState, "int | list[int]"], list[Draft]]


class BatchPlanner(Protocol):
    """The tree of steps that verify B > 1 rows together (e.g. :class:`~.adaptive.BatchGuards`), decided by
    finished steps only: :meth:`tree` before any row drafts, :meth:`record` after the step."""

    def tree(self, batch: int, context: int): ...

    def record(self, batch: int, tokens: int, seconds: float) -> None: ...


def shared_buffers(choices: list[list[int]], device: torch.device | str) -> TreeBuffers:
    """The buffers of ``choices`` on ``device``, built once per process and shared by every plan (read only)."""
    return _buffers(tuple(map(tuple, choices)), str(device))


@lru_cache(maxsize=512)
def _buffers(choices: tuple[tuple[int, ...], ...], device: str) -> TreeBuffers:
    return build_buffers([list(p) for p in choices], device)


class StaticTree:
    """A :data:`Plan` over one fixed tree; buffers per depth cap are built once (near ``max_new_tokens`` or
    the context end, shallower trees). ``sampler``: the drafter draws the tokens instead of ranking them."""

    def __init__(self, drafter: Drafter, choices: list[list[int]], device: torch.device, sampler=None):
        self.drafter, self.choices, self.device, self.sampler = drafter, choices, device, sampler
        self.full = shared_buffers(choices, device)

    def get(self, max_depth: int) -> TreeBuffers:
        depth = max(0, min(max_depth, self.full.depth))
        return self.full if depth == self.full.depth else shared_buffers(truncate(self.choices, depth), self.device)

    @property
    def batch_key(self):
        """Rows of a batched step with this key draft together; a sampling plan's draws are its row's own (None)."""
        return ("static", tree_key(self.choices)) if self.sampler is None else None

    def __call__(self, state: DraftState, max_depth: int | list[int]) -> list[Draft]:
        if isinstance(max_depth, int):
            return self.drafter.propose(state, self.get(max_depth), max_depth, self.sampler)
        drafts: list[Draft | None] = [None] * len(max_depth)
        by_depth: dict[int, list[int]] = {}  # rows whose cap gives the same (truncated) tree draft together
        for b, depth in enumerate(max_depth):
            by_depth.setdefault(min(depth, self.full.depth), []).append(b)
        for depth, rows in by_depth.items():
            for b, draft in zip(rows, self.drafter.propose(state.rows(rows), self.get(depth), depth, self.sampler)):
                drafts[b] = draft
        return drafts


class GrownTree:
    """A :data:`Plan` whose tree the drafter grows anew each step within the budget of a :class:`DynamicTree`."""

    def __init__(self, drafter: Drafter, tree: DynamicTree):
        drafter.require_dynamic_trees()
        self.drafter, self.tree = drafter, tree

    @property
    def batch_key(self):
        return ("grown", self.tree)

    def __call__(self, state: DraftState, max_depth: int | list[int]) -> list[Draft]:
        return self.drafter.propose(state, self.tree, max_depth)


class PromptLookup:
    """A :data:`Plan` that adds a prompt-lookup branch (:func:`medusa_lite.tree.lookup_continuation`) to
    another plan's tree, per row, merged so siblings stay distinct; the tree is then rebuilt for the step."""

    def __init__(self, plan: Plan, tokens: int, ngram: int = 3):
        self.plan, self.tokens, self.ngram = plan, tokens, ngram

    @property
    def batch_key(self):
        inner = getattr(self.plan, "batch_key", None)
        return None if inner is None else ("lookup", inner, self.tokens, self.ngram)

    def __call__(self, state: DraftState, max_depth: int | list[int]) -> list[Draft]:
        depths = per_row(max_depth, len(state.ids))
        return [with_lookup_branch(draft, ids, self.tokens, self.ngram, depth)
                for draft, ids, depth in zip(self.plan(state, max_depth), state.ids, depths)]


def draft_rows(plans: list[Plan], state: DraftState, depths: list[int]) -> list[Draft]:
    """Row b's draft by ``plans[b]`` within ``depths[b]``: the rows whose plans share a ``batch_key`` in one plan call
    (each level of all of them in one pass over the drafter's weights), a row whose plan has none (sampling from a
    static tree: its own draws) alone. Call inside ``Kernels.drafting()`` (:mod:`medusa_lite.kernels`)."""
    groups: dict[object, list[int]] = {}
    for b, plan in enumerate(plans):
        key = getattr(plan, "batch_key", None)
        groups.setdefault(("row", b) if key is None else key, []).append(b)
    drafts: list[Draft | None] = [None] * len(plans)
    for rows in groups.values():
        cap = depths[rows[0]] if len(rows) == 1 else [depths[b] for b in rows]
        for b, draft in zip(rows, plans[rows[0]](state.rows(rows), cap)):
            drafts[b] = draft
    return drafts


def with_lookup_branch(draft: Draft, ids: torch.Tensor, tokens: int, ngram: int, max_depth: int) -> Draft:
    """``draft`` plus the prompt-lookup branch of ``ids`` [L] (root last): up to ``tokens`` tokens, no deeper than
    ``max_depth``, merged under the root so siblings stay distinct."""
    chain = lookup_continuation(ids, ngram, min(tokens, max_depth))
    if chain.numel() == 0:
        return draft
    parents, merged = merge_chain(draft.buffers.parents, draft.tokens.tolist(), chain.tolist())
    if len(parents) == len(draft.buffers.parents):  # the drafter had drafted the whole branch already
        return draft
    # the added nodes come last: their proposals are one-hot (Proposals.at)
    return Draft(torch.tensor(merged, dtype=torch.long, device=ids.device), buffers_from_parents(parents, ids.device),
                 draft.proposals)


def make_plan(drafter: Drafter, tree: TreeSpec, device: torch.device, sampler=None) -> Plan:
    """The per-step plan of ``tree``: a static tree the drafter fills, a tree it grows each step (:class:`DynamicTree`),
    either plus a prompt-lookup branch. ``sampler`` (sampling mode): static trees draw their tokens from the drafter's
    distributions; dynamic trees and prompt-lookup tokens stay deterministic (one-hot proposals)."""
    if isinstance(tree, WithLookup):
        return PromptLookup(make_plan(drafter, tree.tree, device, sampler), tree.tokens, tree.ngram)
    if isinstance(tree, DynamicTree):
        return GrownTree(drafter, tree)
    return StaticTree(drafter, tree, device, sampler)


class PlanCache:
    """``tree (JSON form) -> plan``, each plan made once (:func:`make_plan`): one sequence's plans for the trees its
    fitted plan and its batched steps name."""

    def __init__(self, drafter: Drafter, num_heads: int, device: torch.device, sampler=None):
        self.drafter, self.num_heads, self.device, self.sampler = drafter, num_heads, device, sampler
        self._plans: dict[str, Plan] = {}

    def __call__(self, tree) -> Plan:
        key = tree_key(tree)
        if key not in self._plans:
            self._plans[key] = make_plan(self.drafter, parse_tree(tree, self.num_heads), self.device, self.sampler)
        return self._plans[key]


def first_nodes(draft: Draft, n: int) -> Draft:
    """The draft's tree cut to its first ``n`` nodes. Nodes come parents first and siblings in rank order, so the cut
    is a tree and every kept sampled node keeps the siblings its proposal was drawn after: exact, and decided by
    the budget alone, never by the drafted tokens."""
    if draft.tokens.numel() <= n:
        return draft
    return Draft(draft.tokens[:n], buffers_from_parents(draft.buffers.parents[:n], draft.tokens.device), draft.proposals)
