"""Per-head accuracy: how often each head's rank-r proposal is the token the target itself chooses (teacher-forced
over prompts + the target's own greedy continuations, so the prefix is what an accepted path would be)."""

from __future__ import annotations

import torch

from ..drafters import drafter_features


def topk_hits(ranked: torch.Tensor, target_choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count, per head and rank, how often the head's proposal is the target's own choice.

    ranked: [K, T, topk] each head's ranked proposals at T consecutive positions t = 0..T-1 (from the
    hidden state of t); target_choice: [T] the target's token chosen at each of those positions (the
    token for t + 1). Head k at position t proposes the token for t + 2 + k, i.e.
    ``target_choice[t + 1 + k]``; positions whose answer lies beyond T are skipped.
    Returns (hits [K, topk] long: rank r of head k was right; totals [K] long: positions scored).
    """
    num_heads, length, topk = ranked.shape
    hits = torch.zeros(num_heads, topk, dtype=torch.long)
    totals = torch.zeros(num_heads, dtype=torch.long)
    for k in range(num_heads):
        n = length - 1 - k  # positions t with t + 1 + k < T
        if n <= 0:
            continue
        answer = target_choice[1 + k: 1 + k + n].to(ranked.device)  # [n]
        hits[k] = (ranked[k, :n] == answer[:, None]).long().sum(dim=0).cpu()  # [topk]
        totals[k] = n
    return hits, totals


def accuracies_from_counts(hits: torch.Tensor, totals: torch.Tensor) -> list[list[float]]:
    """hits [K, topk], totals [K] -> ``acc[k][r]`` as used by :func:`medusa_lite.tree.grow_tree`."""
    return [[float(h) / max(int(n), 1) for h in row] for row, n in zip(hits.tolist(), totals.tolist())]


@torch.no_grad()
def measure_head_accuracy(model, sequences: list[tuple[torch.Tensor, int]], topk: int = 10) -> dict:
    """Teacher-forced head accuracy of ``model`` (a :class:`medusa_lite.MedusaModel`).

    sequences: (ids [L] long, start) pairs, ``ids[start:]`` the target's own continuation of the prompt
    ``ids[:start]``; positions from ``start - 1`` on are scored. One target forward per sequence; the
    proposals come from ``model.drafter.ranked`` (what decoding drafts, from the same vocabulary,
    on the path where every earlier proposal was right: Hydra heads read the true tokens).
    Returns ``{"accuracies": [K][topk], "hits": ..., "totals": ...}``.
    """
    target = model.base_model
    hits = torch.zeros(model.config.num_heads, topk, dtype=torch.long)
    totals = torch.zeros(model.config.num_heads, dtype=torch.long)
    for ids, start in sequences:
        out = target(input_ids=ids[None], output_hidden_states=True, return_dict=True, use_cache=False)
        first = max(start - 1, 0)
        hidden = drafter_features(out.hidden_states, model.drafter.hidden_layers)[0]  # [L, F]
        choice = out.logits[0, first:].argmax(dim=-1)  # [T]
        ranked = model.drafter.ranked(hidden, ids, topk)[:, first:]  # [K, T, topk]: the whole context read
        h, n = topk_hits(ranked, choice)
        hits += h
        totals += n
    return {"accuracies": accuracies_from_counts(hits, totals), "hits": hits.tolist(), "totals": totals.tolist()}


@torch.no_grad()
def drafter_inputs(model, ids: torch.Tensor) -> torch.Tensor:
    """[L] ids -> [L, F] the target features ``model``'s drafter reads (one forward, no cache)."""
    out = model.base_model(input_ids=ids[None], output_hidden_states=True, return_dict=True, use_cache=False)
    return drafter_features(out.hidden_states, model.drafter.hidden_layers)[0]
