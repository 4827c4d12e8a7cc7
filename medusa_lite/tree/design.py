"""Designing a tree from per-head accuracies: its expected accepted length (heads taken as independent) and the
greedy growth of the best tree of a given size (Medusa's method)."""

from __future__ import annotations

from .spec import Choices, validate_choices


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
