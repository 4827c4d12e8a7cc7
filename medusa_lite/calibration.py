"""Calibration: fit the candidate tree to a set of heads and to the hardware (DESIGN 3.2).

Two measurements feed one choice:

* per-head accuracy: ``acc[k][r]`` = probability that head k's rank-r proposal is the token the
  target itself chooses at that position (teacher-forced over prompts + the target's own greedy
  continuations, so the prefix is what an accepted path would be);
* the target's forward latency as a function of the number of tree tokens N (root included), with
  a realistic cache, on this machine; plus the per-step cost outside the forward (drafting,
  verification, cache compaction), which is the same for every tree size.

For each candidate size s, :func:`medusa_lite.tree.grow_tree` gives the best tree of s nodes; its
expected tokens per step is :func:`medusa_lite.tree.expected_length` and its expected speed is
``expected_length / (latency(s + 1) + overhead)``. :func:`choose_tree` picks the fastest.

The formula treats heads as independent. :func:`replay_acceptance` measures instead: from every
position of the target's own greedy continuations it drafts the tree exactly as decoding would and
walks it against the true continuation (what greedy verification would accept there). It scores any
tree, including dynamic ones (EAGLE-2 style) the formula cannot, and times the drafting itself.

The first part of this module is pure math (numbers and tensors in, numbers out); the second part
runs the measurements on a model and is what ``medusa-lite calibrate`` calls.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .drafters import drafter_features
from ._hf import cache_kwarg
from .cache import new_cache
from .fit import BUCKETS, bucket_of, interpolate_latency
from .fit.probe import verify_seconds
from .tree import Choices, TreeSpec, build_buffers, chain, expected_length, grow_tree, tree_json
from .verify import accept

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 63)
DEFAULT_LATENCY_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


# ---------------------------------------------------------------------------------------------- math
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




@dataclass
class TreeCandidate:
    """One tree size scored by :func:`choose_tree`."""

    size: int                  # nodes excluding the root
    expected_length: float     # expected tokens per step, bonus included
    latency: float             # seconds per step: forward of size + 1 tokens + overhead
    tokens_per_second: float   # expected_length / latency
    choices: Choices


def score_trees(accuracies: list[list[float]], latency: dict[int, float], sizes=DEFAULT_SIZES,
                overhead: float = 0.0) -> list[TreeCandidate]:
    """Grow the best tree of every size in ``sizes`` and estimate its speed. Sizes that cannot be grown
    (more nodes than the accuracies allow) collapse onto the largest possible tree and are dropped."""
    candidates: list[TreeCandidate] = []
    seen: set[int] = set()
    for size in sorted(set(int(s) for s in sizes)):
        if size < 1:
            raise ValueError(f"tree sizes must be >= 1, got {size}")
        choices = grow_tree(accuracies, size)
        if len(choices) in seen:
            continue
        seen.add(len(choices))
        step = interpolate_latency(latency, len(choices) + 1) + overhead
        length = expected_length(choices, accuracies)
        candidates.append(TreeCandidate(len(choices), length, step, length / step, choices))
    return candidates


def choose_tree(accuracies: list[list[float]], latency: dict[int, float], sizes=DEFAULT_SIZES,
                overhead: float = 0.0) -> tuple[TreeCandidate, list[TreeCandidate]]:
    """The tree maximising expected tokens per second (ties: the smaller tree), and all candidates."""
    candidates = score_trees(accuracies, latency, sizes, overhead)
    best = max(candidates, key=lambda c: (round(c.tokens_per_second, 9), -c.size))
    return best, candidates


def candidates_to_dicts(candidates: list[TreeCandidate]) -> list[dict]:
    return [asdict(c) for c in candidates]


# ------------------------------------------------------------------------------------- measurements
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
def measure_forward_latency(target, tokens=DEFAULT_LATENCY_TOKENS, cache_len: int = 256, repeats: int = 5,
                            seed: int = 0) -> dict[int, dict[str, float]]:
    """Seconds for one cached tree-verify forward of N new tokens, for each N in ``tokens``.

    The cache holds ``cache_len`` random tokens; each forward uses a tree attention mask and explicit
    position ids (as in verification) with hidden states returned, then the cache is cropped back.
    Sizes are interleaved across repeats so machine noise spreads evenly. Returns
    ``{N: {"median": s, "min": s}}``.
    """
    device = target.get_output_embeddings().weight.device
    vocab = target.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(target)
    kw = cache_kwarg(target)
    prefix = torch.randint(0, vocab, (1, cache_len), generator=gen).to(device)
    target(input_ids=prefix, use_cache=True, return_dict=True, **{kw: cache})
    times: dict[int, list[float]] = {int(n): [] for n in tokens}
    for rep in range(repeats + 1):  # repeat 0 is a warm-up
        for n in times:
            buffers = build_buffers(chain(n - 1), device)
            ids = torch.randint(0, vocab, (n,), generator=gen).to(device)
            seconds = verify_seconds(target, cache, ids, buffers, cache_len)  # exactly what decoding runs
            if rep > 0:
                times[n].append(seconds)
    return {n: {"median": statistics.median(ts), "min": min(ts)} for n, ts in times.items()}


@torch.no_grad()
def replay_acceptance(model, sequences: list[tuple[torch.Tensor, int]], tree: TreeSpec, stride: int = 1,
                      features: list[torch.Tensor] | None = None, buckets=BUCKETS) -> dict:
    """Measured tokens per step of ``tree`` on the target's own greedy continuations (greedy decoding).

    At every ``stride``-th position t of ``ids[start - 1:]`` the tree is drafted from the target's hidden
    state at t with the true token at t + 1 as root (what decoding sees after an accepted step), and
    walked against the true continuation with :func:`medusa_lite.verify.accept`: a node is right when
    it holds the target's greedy token after its path. Returns ``{"mean_tokens": accepted + bonus per
    step, "draft_seconds": mean seconds per drafting call, "steps": positions replayed, "mean_nodes":
    tree nodes per step, root included, "by_bucket": the same per context-length bucket}`` (the context of
    a step is the cache length before its root, t + 1; :class:`medusa_lite.fit.Candidate` fields).
    ``features``: the sequences' drafter features [L, F] (:func:`drafter_inputs`), if already computed. The
    drafter's state walks the true sequence by ``start`` and ``commit`` exactly as decoding moves it.
    """
    plan, drafter = model.plan(tree), model.drafter
    total, steps, seconds, nodes_total = 0, 0, 0.0, 0
    per_bucket = BucketCounts(buckets)
    accept_root = torch.zeros(1, dtype=torch.long)
    for i, (ids, start) in enumerate(sequences):
        feats = features[i] if features is not None else drafter_inputs(model, ids)  # [L, F]
        first = max(start - 1, 0)
        state = drafter.start([ids[: first + 2]], feats[None, : first + 1])  # accepted up to first, root ids[first + 1]
        for t in range(first, ids.numel() - 2):
            if (t - first) % stride == 0:
                t0 = time.perf_counter()
                (tokens, buffers, _), = plan(state, ids.numel() - t - 2)
                seconds += time.perf_counter() - t0
                truth = ids[(t + 2 + buffers.depths).clamp(max=ids.numel() - 1)]  # [N] greedy token after each node
                nodes, _ = accept(tokens, truth, buffers.paths)
                total += nodes.numel()  # accepted + bonus
                nodes_total += buffers.num_nodes
                steps += 1
                per_bucket.add(t + 1, nodes.numel(), buffers.num_nodes)
            # the root (position t + 1) accepted alone: the drafter's state moves one position along the truth
            drafter.commit(state, [accept_root.to(ids.device)], feats[None, t + 1: t + 2], [ids[: t + 3]])
    return {"mean_tokens": total / max(steps, 1), "draft_seconds": seconds / max(steps, 1), "steps": steps,
            "mean_nodes": nodes_total / max(steps, 1), "by_bucket": per_bucket.to_dict()}


class BucketCounts:
    """Tokens per step and tree tokens per step, summed per context-length bucket."""

    def __init__(self, buckets=BUCKETS):
        self.buckets = tuple(buckets)
        self.tokens = [0] * len(self.buckets)
        self.nodes = [0] * len(self.buckets)
        self.steps = [0] * len(self.buckets)

    def add(self, context: int, tokens: int, nodes: int) -> None:
        b = bucket_of(context, self.buckets)
        self.tokens[b] += tokens
        self.nodes[b] += nodes
        self.steps[b] += 1

    def to_dict(self) -> dict:
        """``{"tokens_per_step", "nodes", "steps"}`` lists (a bucket without steps: 1.0, plain decoding)."""
        return {"tokens_per_step": [t / s if s else 1.0 for t, s in zip(self.tokens, self.steps)],
                "nodes": [n / s if s else 1.0 for n, s in zip(self.nodes, self.steps)], "steps": list(self.steps)}


@torch.no_grad()
def drafter_inputs(model, ids: torch.Tensor) -> torch.Tensor:
    """[L] ids -> [L, F] the target features ``model``'s drafter reads (one forward, no cache)."""
    out = model.base_model(input_ids=ids[None], output_hidden_states=True, return_dict=True, use_cache=False)
    return drafter_features(out.hidden_states, model.drafter.hidden_layers)[0]


@torch.no_grad()
def measure_sampling(model, prompts: list[torch.Tensor], trees: list[TreeSpec], max_new_tokens: int,
                     temperature: float, seed: int = 0, buckets=BUCKETS) -> list[dict]:
    """Sampled generation with each of ``trees`` after each prompt ([L] ids), measured: tokens per step and
    decoding speed (prefill excluded). Trees alternate per prompt (machine noise spreads evenly) and
    every tree sees the same prompts and seeds.

    Sampling has no fixed continuation to replay against, and sampled drafts are accepted with probability
    min(1, p/q), so trees for sampling are scored by running them. Returns, per tree, ``{"tokens_per_step",
    "tokens_per_second", "steps", "by_bucket"}`` (``by_bucket``: :class:`BucketCounts` by each step's context).
    """
    totals = [[0, 0, 0.0] for _ in trees]  # tokens, steps, seconds
    per_bucket = [BucketCounts(buckets) for _ in trees]
    for i, ids in enumerate(prompts):
        for total, counts, tree in zip(totals, per_bucket, trees):
            generator = torch.Generator(device=model.device).manual_seed(seed + i)
            model.generate(ids[None], max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                           top_k=0, top_p=1.0, tree=tree_json(tree), generator=generator, eos_token_id=None)
            stats = model.last_stats
            total[0] += stats.new_tokens - 1  # the prefill's token is not the tree's
            total[1] += stats.verify_steps
            total[2] += stats.wall_time - stats.prefill_time
            context = ids.numel()  # cache length when the first root (the prefill's token) is verified
            for tokens, nodes in zip(stats.tokens_per_step, stats.nodes_per_step):
                counts.add(context, tokens, nodes)
                context += tokens
    return [{"tokens_per_step": tokens / max(steps, 1), "tokens_per_second": tokens / max(seconds, 1e-9),
             "steps": steps, "by_bucket": counts.to_dict()} for (tokens, steps, seconds), counts in zip(totals, per_bucket)]
