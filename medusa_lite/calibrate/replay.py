"""Measured acceptance: trees replayed on the target's own greedy continuations (:func:`replay_acceptance`) or run
with sampling (:func:`measure_sampling`), per context bucket, and the continuations themselves (:func:`continuations`).

:func:`replay_trees` drafts at the positions greedy decoding would verify at, as decoding would, and walks each
tree against the true continuation (what greedy verification would accept there), every tree in one pass. It scores
any tree, including dynamic ones (EAGLE-2 style) the independence formula cannot.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decode import make_plan
from ..decode.plans import StaticTree, shared_buffers, with_lookup_branch
from ..drafters import Draft
from ..fit import BUCKETS, bucket_of
from ..fit.probe import overhead_per_step
from ..specbench import chat_prompt
from ..tree import DynamicTree, TreeSpec, WithLookup, tree_json, truncate, validate_choices
from ..verify import accept
from .accuracy import drafter_inputs

@torch.no_grad()
def replay_acceptance(model, sequences: list[tuple[torch.Tensor, int]], tree: TreeSpec,
                      features: list[torch.Tensor] | None = None, buckets=BUCKETS) -> dict:
    """Measured tokens per step of ``tree`` on the target's own greedy continuations: :func:`replay_trees` of
    one tree."""
    return replay_trees(model, sequences, [tree], features, buckets)[0]


@torch.no_grad()
def replay_trees(model, sequences: list[tuple[torch.Tensor, int]], trees: list[TreeSpec],
                 features: list[torch.Tensor] | None = None, buckets=BUCKETS, progress: bool = False) -> list[dict]:
    """Measured tokens per step of each of ``trees`` on the target's own greedy continuations (greedy decoding).

    At a step's position t of ``ids[start - 1:]`` a tree is drafted from the target's hidden state at t with
    the true token at t + 1 as root (what decoding sees after an accepted step), and walked against the true
    continuation with :func:`medusa_lite.verify.accept`: a node is right when it holds the target's greedy token
    after its path. A tree's next step is where that step's accepted tokens end, as in greedy decoding: a mean
    over *every* position instead would count a long accepted run once per position inside it (a repetition the
    lookup branch copies scored ~2x its decoding rate on Spec-Bench continuations).

    One pass serves every tree: the drafter's state walks the true sequence once (``start``, then ``commit`` of
    the root at each position, exactly as decoding moves it), and at each position where some static tree steps
    (alone or under a prompt-lookup branch) the union of the static trees is drafted once and each tree's nodes
    are read off it. A node's token depends only on its own path (its ancestors' tokens and ranks), so the union
    holds what each tree alone would draft, up to the float rounding of a wider drafting batch. A tree grown per
    step (:class:`DynamicTree`) is grown once per position for every candidate built on it (with or without a
    lookup branch). Per tree: ``{"mean_tokens": accepted + bonus per
    step, "steps": steps replayed, "mean_nodes": tree nodes per step, root included, "by_bucket": the same per
    context-length bucket}`` (the context of a step is the cache length before its root, t + 1;
    :class:`medusa_lite.fit.Candidate` fields). ``features``: the sequences' drafter features [L, F]
    (:func:`drafter_inputs`), if already computed.
    """
    drafter = model.drafter
    replays = [_Replay(tree, model.drafter, model.heads_device, buckets) for tree in trees]
    union = validate_choices(sorted({tuple(p) for r in replays if r.choices is not None for p in r.choices}))
    node_of = {tuple(p): i + 1 for i, p in enumerate(union)}  # a static tree's nodes within the union's draft
    for r in replays:
        r.index_in(node_of)
    union_plan = StaticTree(drafter, union, model.heads_device)
    accept_root = torch.zeros(1, dtype=torch.long)
    positions = sum(max(ids.numel() - max(start - 1, 0) - 2, 0) for ids, start in sequences)
    bar = tqdm(total=positions, desc=f"replaying {len(trees)} tree(s)", disable=not progress)
    for i, (ids, start) in enumerate(sequences):
        feats = features[i] if features is not None else drafter_inputs(model, ids)  # [L, F]
        first = max(start - 1, 0)
        state = drafter.start([ids[: first + 2]], feats[None, : first + 1])  # accepted up to first, root ids[first + 1]
        for r in replays:
            r.step_at = first
        for t in range(first, ids.numel() - 2):
            stepping = [r for r in replays if r.step_at == t]
            if stepping:
                max_depth = ids.numel() - t - 2
                truth_at = lambda depths: ids[(t + 2 + depths).clamp(max=ids.numel() - 1)]  # noqa: E731
                drafted = union_plan(state, max_depth)[0] if any(r.choices is not None for r in stepping) else None
                grown = {}  # dynamic tree -> its draft at this position
                for r in stepping:
                    r.step(state, drafted, grown, max_depth, t, truth_at)
            # the root (position t + 1) accepted alone: the drafter's state moves one position along the truth
            drafter.commit(state, [accept_root.to(ids.device)], feats[None, t + 1: t + 2], [ids[: t + 3]])
            bar.update(1)
    bar.close()
    return [r.result() for r in replays]


class _Replay:
    """One tree's walk in :func:`replay_trees`: its next step's position and its counts."""

    def __init__(self, tree: TreeSpec, drafter, device: torch.device, buckets=BUCKETS):
        base = tree.tree if isinstance(tree, WithLookup) else tree
        self.lookup = tree if isinstance(tree, WithLookup) else None
        self.choices = None if isinstance(base, DynamicTree) else base  # static: cut from the union's draft
        self.grown = (base, make_plan(drafter, base, device)) if self.choices is None else None
        self.device = device
        self.step_at = 0
        self.total, self.steps, self.nodes = 0, 0, 0
        self.per_bucket = BucketCounts(buckets)

    def index_in(self, node_of: dict) -> None:
        if self.choices is not None:
            self.index = torch.tensor([0] + [node_of[tuple(p)] for p in self.choices], device=self.device)

    def draft(self, state, drafted, grown: dict, max_depth: int):
        """This tree's draft at the state's position (``drafted``: the union's draft, depth capped alike; ``grown``:
        the dynamic trees' drafts at this position so far)."""
        if self.grown is not None:
            base, plan = self.grown
            if base not in grown:
                (grown[base],) = plan(state, max_depth)
            draft = grown[base]
        else:
            choices, index = self.choices, self.index
            if choices and len(choices[-1]) > max_depth:  # near the continuation's end: a shallower tree
                choices = truncate(choices, max_depth)
                index = index[: len(choices) + 1]  # choices are sorted by depth: the kept ones come first
            draft = Draft(drafted.tokens[index], shared_buffers(choices, self.device))
        if self.lookup is not None:
            draft = with_lookup_branch(draft, state.ids[0], self.lookup.tokens, self.lookup.ngram, max_depth)
        return draft

    def step(self, state, drafted, grown: dict, max_depth: int, t: int, truth_at) -> None:
        tokens, buffers, _ = self.draft(state, drafted, grown, max_depth)
        nodes, _ = accept(tokens, truth_at(buffers.depths), buffers.paths)  # [N] greedy token after each node
        self.step_at = t + nodes.numel()  # the next step's position: past the accepted tokens and the bonus
        self.total += nodes.numel()  # accepted + bonus
        self.nodes += buffers.num_nodes
        self.steps += 1
        self.per_bucket.add(t + 1, nodes.numel(), buffers.num_nodes)

    def result(self) -> dict:
        return {"mean_tokens": self.total / max(self.steps, 1), "steps": self.steps,
                "mean_nodes": self.nodes / max(self.steps, 1), "by_bucket": self.per_bucket.to_dict()}


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
                     temperature: float, seed: int = 0, buckets=BUCKETS, progress: bool = False) -> list[dict]:
    """Sampled generation with each of ``trees`` after each prompt ([L] ids), measured: tokens per step and
    decoding speed (prefill excluded). Trees alternate per prompt (machine noise spreads evenly) and
    every tree sees the same prompts and seeds.

    Sampling has no fixed continuation to replay against, and sampled drafts are accepted with probability
    min(1, p/q), so trees for sampling are scored by running them. Returns, per tree, ``{"tokens_per_step",
    "tokens_per_second", "steps", "by_bucket"}`` (``by_bucket``: :class:`BucketCounts` by each step's context).
    """
    totals = [[0, 0, 0.0] for _ in trees]  # tokens, steps, seconds
    per_bucket = [BucketCounts(buckets) for _ in trees]
    bar = tqdm(total=len(prompts) * len(trees), desc=f"sampling {len(trees)} tree(s)", disable=not progress)
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
            bar.update(1)
    bar.close()
    return [{"tokens_per_step": tokens / max(steps, 1), "tokens_per_second": tokens / max(seconds, 1e-9),
             "steps": steps, "by_bucket": counts.to_dict()} for (tokens, steps, seconds), counts in zip(totals, per_bucket)]


def continuations(model, tokenizer, questions, max_new_tokens: int, cache: str | Path | None = None,
                  made_with: dict | None = None) -> tuple[list[tuple[torch.Tensor, int]], float]:
    """[(prompt + the target's greedy continuation of ``max_new_tokens`` [L], prompt length)] and the seconds per
    decoding step spent outside target forwards. With ``cache`` (a JSON file) the sequences (which depend on the
    target, not on the heads) are read from it when its key matches (the questions, ``max_new_tokens`` and
    ``made_with``: e.g. the target and dtype), else generated and written there; the overhead is then measured on
    one short generation."""
    cache = Path(cache) if cache else None
    key = {"question_ids": [q.question_id for q in questions], "max_new_tokens": max_new_tokens, **(made_with or {})}
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
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        stats.append(model.last_stats)
        sequences.append((out[0], ids.shape[1]))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "sequences": [(s.tolist(), p) for s, p in sequences]}) + "\n")
    return sequences, overhead_per_step(stats)
