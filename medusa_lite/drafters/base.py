"""The drafter contract: everything that proposes a tree of tokens for the target to verify.

A drafter is an ``nn.Module`` registered by name (:func:`medusa_lite.drafters.registry.register_drafter`) with its
config class. The speculative loop (:func:`medusa_lite.decode.speculative_generate`) knows only this:

- ``hidden_layers``: which of the target's ``hidden_states`` it reads (-1: the final-norm states), concatenated
  on the last dimension: its features are [..., F] with F = len(hidden_layers) * H.
- ``start(ids, hidden)`` after the prompt's forward, ``propose(state, shape, max_depth, sampler)`` each step
  (one :class:`Draft` per batch row), ``commit(state, accepted, hidden, ids)`` after verification (a
  stateful drafter keeps and compacts its own cache there).
- ``forward(hidden, ids, segments)``: teacher-forced logits for training (``segments``: each position's document,
  so attention never crosses documents), ``loss(...)`` its training objective,
  ``ranked(...)`` teacher-forced proposals for calibration, ``export_vllm(...)`` its vLLM checkpoint.

Shapes are batch-first with per-row lengths: ``DraftState.ids`` is a list of rows, features are ``[B, ...]``.
The frozen target's ``lm_head`` and input embeddings are referenced (:meth:`Drafter.attach`),
never owned: they are neither trained nor saved with the drafter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from ..tree import DynamicTree, TreeBuffers, buffers_from_parents, build_buffers
from ..verify import Proposals


class Draft(NamedTuple):
    """One row's tree for one step: node tokens [N] (root first), its buffers, and which tokens were sampled."""

    tokens: torch.Tensor
    buffers: TreeBuffers
    proposals: Proposals | None = None


@dataclass
class DraftState:
    """What a drafter knows between steps, per batch row.

    ids: per row, every token so far [L_b], ending in the root (the target's next token, not yet in its cache).
    hidden: [B, F] the target features (``hidden_layers``) at each row's last accepted position.
    cache: a stateful drafter's own, one entry per row (e.g. its KV cache); None for heads that read the target
    state only.
    """

    ids: list[torch.Tensor]
    hidden: torch.Tensor
    cache: list | None = None

    def rows(self, index: list[int]) -> "DraftState":
        """The state of rows ``index`` (shares each row's tensors and cache entry)."""
        cache = None if self.cache is None else [self.cache[b] for b in index]
        picked = torch.tensor(index, dtype=torch.long, device=self.hidden.device)
        return DraftState([self.ids[b] for b in index], self.hidden.index_select(0, picked), cache)

    def join(self, other: "DraftState") -> "DraftState":
        """This state's rows followed by ``other``'s."""
        cache = None if self.cache is None and other.cache is None else list(self.cache) + list(other.cache)
        return DraftState(self.ids + other.ids, torch.cat([self.hidden, other.hidden]), cache)


TreeShape = TreeBuffers | DynamicTree  # a static tree's buffers, or the budget of a tree grown per step


def per_row(max_depth: int | list[int], rows: int) -> list[int]:
    """A depth cap for all rows, or one per row, as one per row."""
    return max_depth if isinstance(max_depth, list) else [max_depth] * rows


def num_positions(seq_len: int, num_heads: int) -> int:
    """Positions per training window that every head trains on (the window's last num_heads + 1 only teach)."""
    return seq_len - num_heads - 1


def drafter_features(hidden_states, layers: tuple[int, ...]) -> torch.Tensor:
    """A target forward's ``hidden_states`` -> the features of ``layers`` concatenated on the last dimension."""
    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


class Drafter(nn.Module):
    """Base of every registered drafter; see the module docstring for the contract."""

    name: ClassVar[str]
    config_class: ClassVar[type] = None  # None: MedusaConfig (the heads' shape fields are enough)
    hidden_layers: ClassVar[tuple[int, ...]] = (-1,)
    dynamic_trees: ClassVar[bool] = False  # can grow its own tree each step (EAGLE-2 expansion)
    vllm_refusal: ClassVar[str | None] = None  # why vLLM cannot run it (None: export_vllm is implemented)
    PUBLIC_ARCHITECTURES: ClassVar[tuple[str, ...]] = ()  # config.json architectures that import_public reads

    @classmethod
    def reads_public(cls, public: dict) -> bool:
        """Whether a published checkpoint's ``config.json`` is one :meth:`import_public` reads."""
        return bool(set(public.get("architectures") or []) & set(cls.PUBLIC_ARCHITECTURES))

    @classmethod
    def import_public(cls, public: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """A published checkpoint (its ``config.json``, its tensors) -> (this library's config dict, state)."""
        raise NotImplementedError(f"{cls.__name__} reads no published layout")

    def __init__(self, config):
        super().__init__()
        self.config = config

    @classmethod
    def require_dynamic_trees(cls) -> None:
        """ValueError unless this drafter can grow its own tree each step (a :class:`DynamicTree`)."""
        if not cls.dynamic_trees:
            raise ValueError(f"dynamic trees need a drafter that grows its own tree (Hydra heads, head_type='hydra');"
                             f" {cls.name} proposals do not depend on the path")

    @classmethod
    def complete_config(cls, config, target_config) -> None:
        """Fill the config's shape fields the user left None from the target's config (before building)."""

    # ------------------------------------------------------------------ the frozen target
    def attach(self, target) -> None:
        """Reference the frozen target's output projection and input embeddings (not submodules: not saved)."""
        self.__dict__["_target_io"] = (target.get_output_embeddings(), target.get_input_embeddings())

    def vocabulary_changed(self) -> None:
        """``draft_ids`` were set (training picks the draft vocabulary): re-derive what depends on them."""

    @property
    def target_lm_head(self) -> nn.Module:
        return self.__dict__["_target_io"][0]

    @property
    def target_embed(self) -> nn.Module:
        return self.__dict__["_target_io"][1]

    # ------------------------------------------------------------------ decoding
    def start(self, ids: list[torch.Tensor], hidden: torch.Tensor) -> DraftState:
        """After the prompt's forward. ids: per row [L_b] ending in the root; hidden: [B, L, F] prompt features."""
        last = torch.tensor([row.numel() - 2 for row in ids], device=hidden.device)  # the prompt's last position
        return DraftState(list(ids), hidden[torch.arange(len(ids), device=hidden.device), last])

    def propose(self, state: DraftState, shape: TreeShape, max_depth: int | list[int], sampler=None) -> list[Draft]:
        """One :class:`Draft` per row: a static tree's tokens (``shape``: its buffers, capped at ``max_depth``
        by the caller) or a tree grown within the budget ``shape`` (a :class:`DynamicTree`), no deeper
        than ``max_depth`` (one for all rows, or one per row). With a ``sampler`` tokens are drawn from the
        drafter's distribution."""
        depths = per_row(max_depth, len(state.ids))
        return [self.draft_row(state.hidden[b], ids, shape, depths[b], sampler,
                               None if state.cache is None else state.cache[b]) for b, ids in enumerate(state.ids)]

    def draft_row(self, hidden: torch.Tensor, ids: torch.Tensor, shape: TreeShape, max_depth: int, sampler=None,
                  cache=None) -> Draft:
        """One row's draft: features [F] at the last accepted position, ids [L] ending in the root."""
        raise NotImplementedError

    def commit(self, state: DraftState, accepted: list[torch.Tensor], hidden: torch.Tensor,
               ids: list[torch.Tensor]) -> None:
        """After verification. accepted: per row the accepted node indices [a_b + 1] (root first); hidden: the
        verify forward's features [B, N, F]; ids: per row every token so far, ending in the new root."""
        last = torch.stack([nodes[-1] for nodes in accepted]).to(hidden.device)
        state.hidden = hidden[torch.arange(len(accepted), device=hidden.device), last]
        state.ids = list(ids)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary (``draft_ids``, when the drafter has one) -> token ids."""
        ids = getattr(self, "draft_ids", None)
        return index if ids is None else ids[index]

    # ------------------------------------------------------------------ training, calibration, export
    def ranked(self, hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        """Teacher-forced proposals along a known sequence: features [T, F], ids [T] -> [K, T, topk] token ids."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
             loss: str = "kl", decay: float = 0.8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def export_vllm(cls, config, state: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
        """(vLLM ``config.json`` dict, tensors) for a saved drafter; ValueError naming why where vLLM cannot."""
        raise ValueError(f"vLLM cannot run {cls.name!r} drafters: {cls.vllm_refusal or 'no export written'}")


class PathDrafter(Drafter):
    """A drafter whose proposals depend on the drafted path (Hydra heads, EAGLE-3): trees are drafted level by
    level, each expanded node's row reading its own path, so static trees (filled) and trees grown each step
    (EAGLE-2) share one engine. Subclasses give :meth:`begin` (a row's per-step context) and :meth:`advance`
    (expand one level's nodes into logits over the draft vocabulary), or their ``_rows`` forms (a level of every
    row at once), and :meth:`token_ids`."""

    dynamic_trees = True

    def begin(self, hidden: torch.Tensor, ids: torch.Tensor, cache):
        """A row's drafting context for one step: features [F] of the last accepted position, ids [L] (root last).
        A subclass gives this or :meth:`begin_rows`."""
        if type(self).begin_rows is PathDrafter.begin_rows:
            raise NotImplementedError
        return self.begin_rows([hidden], [ids], [cache])[0]

    def advance(self, ctx, depth: int, parent_rows: torch.Tensor, tokens: torch.Tensor, nodes: list[int],
                parents: list[int]) -> torch.Tensor:
        """Expand M nodes of ``depth`` (node ids ``nodes``, tokens [M]; depth 0: the root) whose parents are rows
        ``parent_rows`` [M] of the previous call (depth 0: row 0); ``parents[n]`` is node n's parent.
        Returns [M, V'] logits of their children. A subclass gives this or :meth:`advance_rows`."""
        if type(self).advance_rows is PathDrafter.advance_rows:
            raise NotImplementedError
        return self.advance_rows([ctx], [(depth, parent_rows, tokens, nodes, parents)])[0]

    def begin_rows(self, hidden: list[torch.Tensor], ids: list[torch.Tensor], caches: list) -> list:
        """:meth:`begin` for several rows at once (a drafter may batch their work: one pass over its weights)."""
        return [self.begin(h, row, cache) for h, row, cache in zip(hidden, ids, caches)]

    def advance_rows(self, ctxs: list, requests: list[tuple]) -> list[torch.Tensor]:
        """:meth:`advance` for several rows at once: ``requests[r]`` = (depth, parent_rows, tokens, nodes, parents)
        of row context ``ctxs[r]`` -> each row's [M_r, V'] logits (a drafter may batch them: one pass over its
        weights for all rows, the bulk of a step's drafting once many rows share steps)."""
        return [self.advance(ctx, *request) for ctx, request in zip(ctxs, requests)]

    @torch.no_grad()
    def draft_row(self, hidden, ids, shape, max_depth, sampler=None, cache=None) -> Draft:
        return self.propose(DraftState([ids], hidden[None], None if cache is None else [cache]), shape, max_depth,
                            sampler)[0]

    @torch.no_grad()
    def propose(self, state: DraftState, shape: TreeShape, max_depth: int | list[int], sampler=None) -> list[Draft]:
        """Every row's tree drafted in lockstep: each level of all rows in one :meth:`advance_rows` call.
        ``max_depth``: one for all rows, or per row (a grown tree's cap; a static tree comes capped)."""
        rows = len(state.ids)
        depths = per_row(max_depth, rows)
        grown = isinstance(shape, DynamicTree)
        drafting = [b for b in range(rows) if (min(shape.depth, depths[b]) >= 1 if grown else shape.num_nodes > 1)]
        drafts: list[Draft | None] = [None] * rows
        for b in set(range(rows)) - set(drafting):  # the root alone: nothing to draft
            root = state.ids[b][-1:].clone()
            drafts[b] = Draft(root, build_buffers([], root.device) if grown else shape)
        ctxs = self.begin_rows([state.hidden[b] for b in drafting], [state.ids[b] for b in drafting],
                               [None if state.cache is None else state.cache[b] for b in drafting])
        walks = [self.grow(ctx, state.ids[b], min(shape.depth, depths[b]), shape) if grown
                 else self.fill(ctx, state.ids[b], shape, sampler) for b, ctx in zip(drafting, ctxs)]
        for b, draft in zip(drafting, self._lockstep(ctxs, walks)):
            drafts[b] = draft
        return drafts

    def _lockstep(self, ctxs: list, walks: list) -> list[Draft]:
        """Run the rows' drafting generators (:meth:`fill`, :meth:`grow`: each yields its next level's
        :meth:`advance` request, is sent the logits, and returns its Draft) together, a level a call."""
        drafts: list[Draft | None] = [None] * len(walks)
        waiting: dict[int, tuple] = {}

        def resume(r: int, logits) -> None:
            try:
                waiting[r] = walks[r].send(logits)
            except StopIteration as done:
                drafts[r] = done.value

        for r in range(len(walks)):
            resume(r, None)
        while waiting:
            asked, requests = list(waiting), list(waiting.values())
            waiting.clear()
            for r, logits in zip(asked, self.advance_rows([ctxs[r] for r in asked], requests)):
                resume(r, logits)
        return drafts

    def fill(self, ctx, ids: torch.Tensor, buffers: TreeBuffers, sampler):
        """A static tree's tokens, level by level; with a ``sampler`` each row's children are drawn from the
        drafter's processed distribution (their :class:`Proposals` kept for verification). A generator
        (:meth:`_lockstep`): yields each level's :meth:`advance` request, returns the Draft."""
        n = buffers.num_nodes
        tokens = ids[-1].repeat(n)  # [N], root at 0
        row = torch.full((n,), -1, dtype=torch.long, device=ids.device)  # where each node was drawn from
        rank = torch.zeros(n, dtype=torch.long, device=ids.device)
        qs, draws, offset = [], [], 0
        for d, level in enumerate(buffers.levels):
            logits = yield d, level.parent_row, tokens[level.expand], level.expand.tolist(), buffers.parents  # [M, V']
            if sampler is None:
                ranked = self.token_ids(logits.topk(level.topk, dim=-1).indices)  # [M, topk]
            else:
                q, drawn = sampler(logits, level.topk)  # [M, V'], [M, topk]
                ranked = self.token_ids(drawn)
                row[level.children], rank[level.children] = offset + level.child_row, level.child_rank
                qs.append(q)
                draws.append(drawn)
                offset += q.shape[0]
            tokens[level.children] = ranked[level.child_row, level.child_rank]
        if not qs:
            return Draft(tokens, buffers)
        width = max(t.shape[1] for t in draws)
        drawn = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in draws])
        return Draft(tokens, buffers, Proposals(torch.cat(qs), drawn, row, rank, getattr(self, "draft_ids", None)))

    def grow(self, ctx, ids: torch.Tensor, depth: int, tree: DynamicTree):
        """A tree grown for this step (EAGLE-2): level d expands the ``tree.expand`` best nodes of depth d into
        their ``tree.topk`` most likely children, scored by the summed log-probability of their path; the
        ``tree.nodes`` best scored nodes are kept. A child's score is below its parent's (ties broken by depth),
        so the kept set contains every kept node's ancestors. Candidate c is node c + 1 (the root is 0).
        Growth stops after a level whose best node's path probability is below ``tree.min_prob``. A generator, as
        :meth:`fill` is."""
        root = ids[-1:]
        if depth < 1:
            return Draft(root, build_buffers([], root.device))
        device = root.device
        parent_rows = torch.zeros(1, dtype=torch.long, device=device)  # [M] row of each expanded node's parent
        tokens, nodes = root, [0]                                      # [M] expanded nodes' tokens and ids
        scores = torch.zeros(1, device=device)                         # [M] path log-probability of each row
        parents = [-1]                                                 # parent of every node so far
        all_tokens, all_scores = [], []
        floor = math.log(tree.min_prob) if tree.min_prob > 0 else -math.inf
        for d in range(depth):
            logits = yield d, parent_rows, tokens, nodes, parents  # [M, V']
            logp, idx = torch.log_softmax(logits.float(), dim=-1).topk(tree.topk, dim=-1)  # [M, k]
            child_tokens = self.token_ids(idx).flatten()              # [M * k]
            child_scores = (scores[:, None] + logp - 1e-4).flatten()  # strictly below the parent
            first = len(parents)
            parents += [p for p in nodes for _ in range(tree.topk)]
            all_tokens.append(child_tokens)
            all_scores.append(child_scores)
            if d + 1 == depth or float(child_scores.max()) < floor:
                break
            pick = child_scores.topk(min(tree.expand, child_scores.numel())).indices  # [M']
            parent_rows, tokens, scores = pick // tree.topk, child_tokens[pick], child_scores[pick]
            nodes = (first + pick).tolist()
        cand_tokens, cand_scores = torch.cat(all_tokens), torch.cat(all_scores)
        keep = sorted(cand_scores.topk(min(tree.nodes, cand_scores.numel())).indices.tolist())  # parents first
        node_of = {0: 0} | {c + 1: i + 1 for i, c in enumerate(keep)}
        kept_parents = [-1] + [node_of[parents[c + 1]] for c in keep]
        out = torch.cat([root, cand_tokens[torch.tensor(keep, device=device)]])
        return Draft(out, buffers_from_parents(kept_parents, device))
