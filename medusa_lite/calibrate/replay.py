"""Measured acceptance: trees replayed on the target's own greedy continuations (:func:`replay_acceptance`) or run
with sampling (:func:`measure_sampling`), per context bucket, and the continuations themselves (:func:`continuations`).

:func:`replay_acceptance` drafts at the positions greedy decoding would verify at, exactly as decoding would, and
walks the tree against the true continuation (what greedy verification would accept there). It scores any tree,
including dynamic ones (EAGLE-2 style) the independence formula cannot, and times the drafting itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..fit import BUCKETS, bucket_of
from ..fit.probe import overhead_per_step
from ..specbench import chat_prompt
from ..tree import TreeSpec, tree_json
from ..verify import accept
from .accuracy import drafter_inputs

@torch.no_grad()
def replay_acceptance(model, sequences: list[tuple[torch.Tensor, int]], tree: TreeSpec,
                      features: list[torch.Tensor] | None = None, buckets=BUCKETS) -> dict:
    """Measured tokens per step of ``tree`` on the target's own greedy continuations (greedy decoding).

    At a step's position t of ``ids[start - 1:]`` the tree is drafted from the target's hidden state at t with
    the true token at t + 1 as root (what decoding sees after an accepted step), and walked against the true
    continuation with :func:`medusa_lite.verify.accept`: a node is right when it holds the target's greedy token
    after its path. The next step is where that step's accepted tokens end, as in greedy decoding: a mean over
    *every* position instead would count a long accepted run once per position inside it (a repetition the
    lookup branch copies scored ~2x its decoding rate on Spec-Bench continuations). Returns ``{"mean_tokens":
    accepted + bonus per step, "draft_seconds": mean seconds per drafting call, "steps": steps replayed, "mean_nodes":
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
        step_at = first
        for t in range(first, ids.numel() - 2):
            if t == step_at:
                t0 = time.perf_counter()
                (tokens, buffers, _), = plan(state, ids.numel() - t - 2)
                seconds += time.perf_counter() - t0
                truth = ids[(t + 2 + buffers.depths).clamp(max=ids.numel() - 1)]  # [N] greedy token after each node
                nodes, _ = accept(tokens, truth, buffers.paths)
                step_at = t + nodes.numel()  # the next step's position: past the accepted tokens and the bonus
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


def continuations(model, tokenizer, questions, args) -> tuple[list[tuple[torch.Tensor, int]], float]:
    """[(prompt + the target's greedy continuation [L], prompt length)] and the seconds per decoding step
    spent outside target forwards. With ``--continuations FILE`` the sequences (which depend on the target,
    not on the heads) are read from FILE when it matches, else generated and written there; the overhead
    is then measured on one short generation."""
    cache = Path(args.continuations) if args.continuations else None
    key = {"question_ids": [q.question_id for q in questions], "max_new_tokens": args.max_new_tokens,
           "dtype": args.dtype, "target": args.target}
    sequences, stats = [], []
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            sequences = [(torch.tensor(ids), start) for ids, start in saved["sequences"]]
            model.generate(sequences[0][0][None, :sequences[0][1]], max_new_tokens=32, do_sample=False)
            return sequences, overhead_per_step([model.last_stats])
        print(f"{cache} was made for other settings: generating the continuations again")
    for q in questions:
        ids = chat_prompt(tokenizer, q.prompt)
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        stats.append(model.last_stats)
        sequences.append((out[0], ids.shape[1]))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "sequences": [(s.tolist(), p) for s, p in sequences]}) + "\n")
    return sequences, overhead_per_step(stats)
