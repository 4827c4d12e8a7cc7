"""Prompt lookup: the tokens that followed the latest earlier occurrence of the trailing n-gram, and their chain
merged into a drafted tree as one more branch (siblings kept distinct)."""

from __future__ import annotations

import torch


def lookup_continuation(ids: torch.Tensor, ngram: int, length: int) -> torch.Tensor:
    """Prompt lookup: ids [L] -> ``length`` tokens that followed the latest earlier occurrence of the longest
    trailing n-gram (n = ``ngram`` down to 1); empty when none recurs.

    Where fewer than ``length`` tokens follow the occurrence, the text since it repeats with period p = those
    tokens, and the chain goes on around the period: what the rule itself would draft at each later step if its
    drafts were accepted (a loop of a few tokens, as small models write, drafts ``length`` tokens, not p)."""
    total = ids.numel()
    for n in range(min(ngram, total - 1), 0, -1):
        windows = ids[: total - 1].unfold(0, n, 1)  # [total - n, n]: every earlier n-gram
        hits = (windows == ids[total - n:]).all(dim=-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            period = total - start
            return ids[start + torch.arange(length, device=ids.device) % period]  # [length]
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
