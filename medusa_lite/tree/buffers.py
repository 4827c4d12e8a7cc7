"""The buffers of a tree, built once per tree: ancestor mask, depths, paths, per-level gather indices; the node
tokens from the heads' ranked proposals, and the additive attention biases of a verify forward (full and
sliding-window layers). Tensors in, tensors out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import Choices, validate_choices


@dataclass
class TreeBuffers:
    """Everything the verification step needs about one tree, built once.

    N = number of nodes including the root, P = number of root-to-leaf paths, D = tree depth.
    """

    choices: Choices
    depths: torch.Tensor        # [N] long, root 0
    draft_index: torch.Tensor   # [N-1] long, index into the flattened [K * topk] head proposals
    ancestor_mask: torch.Tensor  # [N, N] bool, node i sees node j (j is i or an ancestor of i)
    paths: torch.Tensor         # [P, D + 1] long node indices, root first, padded with -1
    topk: int                   # the largest rank used + 1
    depth: int                  # D
    levels: list["Level"]       # per depth d < D: which nodes expand and where their children go
    parents: list[int]          # [N] parent node of every node, -1 for the root

    @property
    def num_nodes(self) -> int:
        return int(self.depths.numel())

    def to(self, device: torch.device | str) -> "TreeBuffers":
        return TreeBuffers(self.choices, self.depths.to(device), self.draft_index.to(device),
                           self.ancestor_mask.to(device), self.paths.to(device), self.topk, self.depth,
                           [level.to(device) for level in self.levels], self.parents)


@dataclass
class Level:
    """Depth d of a tree, for drafters whose proposals depend on the path (Hydra heads).

    The M nodes of depth d that have children are expanded, one draft row each; their C children
    (depth d + 1) take the ``child_rank``-ranked token of their parent's row.
    """

    expand: torch.Tensor      # [M] long, node indices of depth d with children
    parent_row: torch.Tensor  # [M] long, row of each expanded node's parent among depth d - 1's rows
    children: torch.Tensor    # [C] long, node indices of depth d + 1
    child_row: torch.Tensor   # [C] long, row (into ``expand``) of each child's parent
    child_rank: torch.Tensor  # [C] long, rank of each child among its parent's proposals
    topk: int                 # largest child rank + 1

    def to(self, device: torch.device | str) -> "Level":
        return Level(self.expand.to(device), self.parent_row.to(device), self.children.to(device),
                     self.child_row.to(device), self.child_rank.to(device), self.topk)


def _levels(choices: Choices, index: dict[tuple[int, ...], int], depth: int) -> list[Level]:
    """Per depth d < ``depth``: the expanded nodes, their parents' rows and their children (see :class:`Level`)."""
    levels: list[Level] = []
    rows_above: dict[tuple[int, ...], int] = {(): 0}
    for d in range(depth):
        kids = [tuple(p) for p in choices if len(p) == d + 1]
        expand = sorted({k[:-1] for k in kids}, key=lambda p: index[p])
        rows = {p: r for r, p in enumerate(expand)}
        levels.append(Level(
            expand=torch.tensor([index[p] for p in expand], dtype=torch.long),
            parent_row=torch.tensor([rows_above[p[:-1]] if p else 0 for p in expand], dtype=torch.long),
            children=torch.tensor([index[k] for k in kids], dtype=torch.long),
            child_row=torch.tensor([rows[k[:-1]] for k in kids], dtype=torch.long),
            child_rank=torch.tensor([k[-1] for k in kids], dtype=torch.long),
            topk=max(k[-1] for k in kids) + 1))
        rows_above = rows
    return levels


def build_buffers(choices: Choices, device: torch.device | str = "cpu") -> TreeBuffers:
    """Tree choices -> :class:`TreeBuffers` (mask, depths, gather indices, root-to-leaf paths).

    An empty ``choices`` is the root alone: one plain decoding step.
    """
    choices = validate_choices(choices) if choices else []
    index = {(): 0} | {tuple(p): i + 1 for i, p in enumerate(choices)}
    n = len(choices) + 1
    topk = max((max(p) for p in choices), default=0) + 1
    depth = max((len(p) for p in choices), default=0)
    depths = torch.tensor([0] + [len(p) for p in choices], dtype=torch.long)
    # node at depth d holds head (d-1)'s token of rank p[-1]
    draft_index = torch.tensor([(len(p) - 1) * topk + p[-1] for p in choices], dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for p in choices:
        i = index[tuple(p)]
        for d in range(1, len(p)):
            mask[i, index[tuple(p[:d])]] = True
    parents = {tuple(p[:-1]) for p in choices}
    leaves = [tuple(p) for p in choices if tuple(p) not in parents]
    leaves = leaves or [()]
    paths = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        nodes = [0] + [index[leaf[:d]] for d in range(1, len(leaf) + 1)]
        paths[row, : len(nodes)] = torch.tensor(nodes)
    parent_of = [-1] + [index[tuple(p[:-1])] for p in choices]
    return TreeBuffers(choices, depths, draft_index, mask, paths, topk, depth, _levels(choices, index, depth),
                       parent_of).to(device)


def buffers_from_parents(parents: list[int], device: torch.device | str = "cpu") -> TreeBuffers:
    """Verification buffers of a tree given by parent pointers (a tree chosen per step, EAGLE-2 style).

    parents[i]: index of node i's parent, ``parents[0] == -1`` for the root; parents precede children.
    Only what verification reads is filled (depths, ancestor mask, paths); ``choices`` is empty.
    """
    n = len(parents)
    depths = [0] * n
    ancestors: list[list[int]] = [[0]]
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        depths[i] = depths[p] + 1
        ancestors.append(ancestors[p] + [i])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, row in enumerate(ancestors):
        mask[i, row] = True
    is_parent = set(parents[1:])
    leaves = [i for i in range(n) if i not in is_parent]
    depth = max(depths)
    paths = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for r, leaf in enumerate(leaves):
        paths[r, : len(ancestors[leaf])] = torch.tensor(ancestors[leaf])
    empty = torch.zeros(0, dtype=torch.long)
    return TreeBuffers([], torch.tensor(depths), empty, mask, paths, 0, depth, [], list(parents)).to(device)


def tree_tokens(root: torch.Tensor, draft_topk: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
    """Token of every node.

    root: [] long, the already chosen next token; draft_topk: [K, topk] long, each head's ranked
    proposals (only the first ``buffers.depth`` heads and ``buffers.topk`` ranks are read).
    Returns [N] long.
    """
    flat = draft_topk[: buffers.depth, : buffers.topk].reshape(-1)  # [D * topk]
    return torch.cat([root.reshape(1), flat[buffers.draft_index]])


def attention_bias(buffers: TreeBuffers, cache_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D attention mask for the verify pass: every node sees the whole cache and its ancestors.

    Returns [1, 1, N, cache_len + N] in ``dtype``: 0 where attended, the dtype's minimum elsewhere.
    An additive float mask works for both the eager and the SDPA attention of transformers.
    """
    n = buffers.num_nodes
    allowed = torch.ones(n, cache_len + n, dtype=torch.bool, device=buffers.depths.device)
    allowed[:, cache_len:] = buffers.ancestor_mask
    bias = torch.zeros(n, cache_len + n, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None]


def within_window(query: torch.Tensor, key: torch.Tensor, window: int, chunked: bool = False) -> torch.Tensor:
    """Whether a query at position ``query`` [..., Q, 1] may see a key at ``key`` [..., 1, K] (causality aside):
    sliding, ``query - key < window`` (transformers' ``sliding_window_overlay``); chunked, both in one chunk of
    ``window`` positions (``chunked_overlay``, Llama 4)."""
    return (query // window == key // window) if chunked else (query - key < window)


def sliding_attention_bias(buffers: TreeBuffers, cache_len: int, dtype: torch.dtype, window: int,
                           kv_start: int = 0, chunked: bool = False) -> torch.Tensor:
    """Additive 4D mask for a sliding-window layer: node i (position ``cache_len + depth[i]``) sees a
    cached position p when ``pos(i) - p < window`` and an ancestor j (or itself) when
    ``depth[i] - depth[j] < window``: the window counted from the node's own position, as
    transformers' ``sliding_window_overlay`` does for a plain sequence. ``chunked``: a chunked layer's
    (:func:`within_window`), positions seen when in the node's own chunk.

    The layer's keys are cache positions ``[kv_start, cache_len)`` (what a sliding layer still holds)
    followed by the N tree nodes. Returns [1, 1, N, cache_len - kv_start + N] in ``dtype``.
    """
    depths = buffers.depths
    device = depths.device
    prefix = torch.arange(kv_start, cache_len, device=device)  # [cache_len - kv_start] cached positions
    nodes = cache_len + depths                                  # [N] the nodes' positions
    see_prefix = within_window(nodes[:, None], prefix[None, :], window, chunked)  # [N, P]
    see_tree = buffers.ancestor_mask & within_window(nodes[:, None], nodes[None, :], window, chunked)  # [N, N]
    allowed = torch.cat([see_prefix, see_tree], dim=1)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None]
