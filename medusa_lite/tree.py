"""Candidate trees: Medusa's ``medusa_choices`` format -> buffers built once per tree.

A tree is a list of paths of top-k ranks, e.g. ``[[0], [1], [0, 0], [0, 1]]``: node ``[0, 1]`` holds
head 0's top-1 token followed by head 1's top-2 token. Node 0 is the root: the token already chosen
from the target's distribution, not yet in the KV cache. A node at depth d (d >= 1) holds the
``path[-1]``-ranked token of head ``d - 1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .paths import resolve_config

Choices = list[list[int]]


def validate_choices(choices: Choices, num_heads: int | None = None) -> Choices:
    """Sort ``choices`` by (depth, ranks) and check that every node's parent is in the tree.

    ``[]`` is the root alone (plain decoding in the speculative loop: what calibration stores when no
    tree pays). Raises ``ValueError`` naming the offending path.
    """
    if not isinstance(choices, (list, tuple)):
        raise ValueError("a tree must be a list of paths such as [[0], [0, 0], [1]]")
    if not choices:
        return []
    paths = []
    for path in choices:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"tree path {path!r} must be a non-empty list of non-negative integer ranks")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise ValueError("tree has duplicate paths")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"tree path {list(path)} has no parent {list(path[:-1])} in the tree")
    depth = max(len(p) for p in paths)
    if num_heads is not None and depth > num_heads:
        raise ValueError(f"tree depth {depth} needs {depth} heads but the model has {num_heads}")
    return [list(p) for p in sorted(paths, key=lambda p: (len(p), p))]


@dataclass(frozen=True)
class DynamicTree:
    """A tree chosen anew at every step from the heads' own scores (EAGLE-2 style, Hydra heads).

    Level by level, the ``expand`` best nodes of the deepest level (by the summed log-probability
    of their path under the heads) get their ``topk`` most likely children, down to ``depth``; then
    the ``nodes`` best nodes overall (root excluded) are verified. ``min_prob``: growth stops after a level
    whose best node's path probability is below it (deep levels the drafter is unsure of cost a drafting pass
    and are rarely accepted). JSON form:
    ``{"dynamic": {"nodes": 16, "depth": 4, "topk": 4, "expand": 4, "min_prob": 0.05}}``.
    """

    nodes: int
    depth: int
    topk: int = 4
    expand: int = 4
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "depth", "topk", "expand"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dynamic tree {name} must be a positive integer, got {value!r}")
        p = self.min_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
            raise ValueError(f"dynamic tree min_prob must be a number in [0, 1), got {p!r}")

    def to_json(self) -> dict:
        spec = {"nodes": self.nodes, "depth": self.depth, "topk": self.topk, "expand": self.expand}
        return {"dynamic": spec | ({"min_prob": self.min_prob} if self.min_prob else {})}


@dataclass(frozen=True)
class WithLookup:
    """A tree plus a prompt-lookup branch: up to ``tokens`` tokens that followed the latest earlier
    occurrence of the trailing n-gram (n <= ``ngram``) of the text so far, merged into the tree under
    the root (where they agree with drafted nodes they share them). JSON form:
    ``{"tree": <tree>, "prompt_lookup": 8}``. Heads cannot copy from the prompt; this branch can."""

    tree: "Choices | DynamicTree"
    tokens: int
    ngram: int = 3

    def to_json(self) -> dict:
        return {"tree": tree_json(self.tree), "prompt_lookup": self.tokens, "ngram": self.ngram}


TreeSpec = Choices | DynamicTree | WithLookup


def parse_tree(spec, num_heads: int | None = None) -> TreeSpec:
    """A tree in JSON form -> validated choices (static) or :class:`DynamicTree`; ValueError naming the problem."""
    if isinstance(spec, (DynamicTree, WithLookup)):
        tree = spec
    elif isinstance(spec, dict) and "prompt_lookup" in spec:
        unknown = set(spec) - {"tree", "prompt_lookup", "ngram"}
        if unknown or "tree" not in spec:
            raise ValueError(f"a tree with prompt lookup is {{'tree': ..., 'prompt_lookup': N}}, got keys {sorted(spec)}")
        tokens, ngram = spec["prompt_lookup"], spec.get("ngram", 3)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (tokens, ngram)):
            raise ValueError(f"prompt_lookup and ngram must be positive integers, got {tokens!r}, {ngram!r}")
        return WithLookup(parse_tree(spec["tree"], num_heads), tokens, ngram)
    elif isinstance(spec, dict) and set(spec) == {"dynamic"} and isinstance(spec["dynamic"], dict):
        unknown = set(spec["dynamic"]) - {"nodes", "depth", "topk", "expand", "min_prob"}
        if unknown:
            raise ValueError(f"dynamic tree has unknown keys {sorted(unknown)}")
        tree = DynamicTree(**spec["dynamic"])
    else:
        return validate_choices(spec, num_heads)
    if isinstance(tree, WithLookup):
        return tree
    if num_heads is not None and tree.depth > num_heads:
        raise ValueError(f"dynamic tree depth {tree.depth} needs {tree.depth} heads but the model has {num_heads}")
    return tree


def tree_nodes(tree: TreeSpec) -> int:
    """Nodes verified per step, root excluded (at most: a dynamic tree's budget, plus the lookup branch)."""
    if isinstance(tree, WithLookup):
        return tree_nodes(tree.tree) + tree.tokens
    return tree.nodes if isinstance(tree, DynamicTree) else len(tree)


def tree_json(tree: TreeSpec):
    """The JSON form of a tree (a list of paths, or ``{"dynamic": {...}}``)."""
    return tree.to_json() if isinstance(tree, (DynamicTree, WithLookup)) else tree


def chain(depth: int) -> Choices:
    """The chain tree ``[[0], [0, 0], ...]`` of the given depth."""
    return [[0] * d for d in range(1, depth + 1)]


def load_tree(path: str | Path) -> TreeSpec:
    """Read a tree JSON file (or a shipped tree by name, ``'medusa-16'``): a list of paths,
    ``{"choices": [...]}`` or ``{"dynamic": {...}}``."""
    data = json.loads(resolve_config("trees", path).read_text())
    return parse_tree(data["choices"] if isinstance(data, dict) and "choices" in data else data)


def tree_key(tree) -> str:
    """A stable text key of a tree's JSON form (dict keys sorted)."""
    return json.dumps(tree, sort_keys=True, separators=(",", ":"))


def truncate(choices: Choices, max_depth: int) -> Choices:
    """Keep only the nodes of depth <= ``max_depth``."""
    return [p for p in choices if len(p) <= max_depth]


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


def lookup_continuation(ids: torch.Tensor, ngram: int, length: int) -> torch.Tensor:
    """Prompt lookup: ids [L] -> up to ``length`` tokens that followed the latest earlier occurrence of
    the longest trailing n-gram (n = ``ngram`` down to 1); empty when none recurs."""
    total = ids.numel()
    for n in range(min(ngram, total - 1), 0, -1):
        windows = ids[: total - 1].unfold(0, n, 1)  # [total - n, n]: every earlier n-gram
        hits = (windows == ids[total - n:]).all(dim=-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start: start + length]
    return ids[:0]


def merge_chain(parents: list[int], tokens: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """Add ``chain`` as a path under the root (node 0), walking into existing children that hold the same
    token, so siblings stay distinct (which the acceptance rules need). Returns new (parents, tokens)."""
    parents, tokens = list(parents), list(tokens)
    child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
    node = 0
    for token in chain:
        nxt = child.get((node, token))
        if nxt is None:
            parents.append(node)
            tokens.append(token)
            nxt = child[(node, token)] = len(parents) - 1
        node = nxt
    return parents, tokens


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


def sliding_attention_bias(buffers: TreeBuffers, cache_len: int, dtype: torch.dtype, window: int,
                           kv_start: int = 0) -> torch.Tensor:
    """Additive 4D mask for a sliding-window layer: node i (position ``cache_len + depth[i]``) sees a
    cached position p when ``pos(i) - p < window`` and an ancestor j (or itself) when
    ``depth[i] - depth[j] < window``: the window counted from the node's own position, as
    transformers' ``sliding_window_overlay`` does for a plain sequence.

    The layer's keys are cache positions ``[kv_start, cache_len)`` (what a sliding layer still holds)
    followed by the N tree nodes. Returns [1, 1, N, cache_len - kv_start + N] in ``dtype``.
    """
    depths = buffers.depths
    device = depths.device
    prefix = torch.arange(kv_start, cache_len, device=device)  # [cache_len - kv_start] cached positions
    see_prefix = (cache_len + depths)[:, None] - prefix[None, :] < window  # [N, P]
    see_tree = buffers.ancestor_mask & ((depths[:, None] - depths[None, :]) < window)  # [N, N]
    allowed = torch.cat([see_prefix, see_tree], dim=1)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None]


def expected_length(choices: Choices, accuracies: list[list[float]]) -> float:
    """Expected accepted tokens per step (bonus included) of a tree.

    ``accuracies[k][r]``: probability that head k's rank-r token is the target's next token.
    Each node contributes the product of accuracies along its path (Medusa's estimate).
    """
    total = 1.0
    for path in choices:
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= accuracies[depth][rank]
        total += prob
    return total


def grow_tree(accuracies: list[list[float]], size: int) -> Choices:
    """Greedily add the node with the largest path probability until the tree has ``size`` nodes.

    The root is not counted. ``accuracies`` as in :func:`expected_length`; depth is capped by the
    number of heads and ranks by the number of accuracies given per head.
    """
    frontier = {(r,): accuracies[0][r] for r in range(len(accuracies[0]))}
    tree: list[tuple[int, ...]] = []
    while len(tree) < size and frontier:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-r for r in p)))
        prob = frontier.pop(path)
        tree.append(path)
        if len(path) < len(accuracies):
            for r, acc in enumerate(accuracies[len(path)]):
                frontier[path + (r,)] = prob * acc
    return validate_choices([list(p) for p in tree])
