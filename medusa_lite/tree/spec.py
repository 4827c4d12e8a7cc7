"""Tree specs: Medusa's ``medusa_choices`` paths, dynamic trees and prompt-lookup branches; parsing, JSON form,
keys and shipped trees.

A tree is a list of paths of top-k ranks, e.g. ``[[0], [1], [0, 0], [0, 1]]``: node ``[0, 1]`` holds
head 0's top-1 token followed by head 1's top-2 token. Node 0 is the root: the token already chosen
from the target's distribution, not yet in the KV cache. A node at depth d (d >= 1) holds the
``path[-1]``-ranked token of head ``d - 1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..paths import resolve_config

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
    elif isinstance(spec, dict) and set(spec) == {"tree"}:  # the lookup form without its branch: the tree itself
        return parse_tree(spec["tree"], num_heads)
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


def has_lookup(tree) -> bool:
    """Whether ``tree`` (JSON form or parsed) has a prompt-lookup branch."""
    return isinstance(tree, WithLookup) or (isinstance(tree, dict) and "prompt_lookup" in tree)


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
