"""The speculative loop: draft a tree, verify it in one target forward, keep the accepted path.

The engine sees token ids only. Per step: the root (the token already chosen, not yet in the cache)
and the heads' proposals form a tree; one target forward scores every node; the target's choice at
every node (argmax or one draw) decides the accepted path; the cache keeps that path; the bonus
token (the choice at the last accepted node) becomes the next root.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from .cache import keep_accepted, new_cache, tree_attention_mask
from .config import text_config
from .drafters import Draft, Drafter, DraftState, drafter_features
from .sampling import build_warpers, target_probs
from .tree import DynamicTree, TreeBuffers, buffers_from_parents, build_buffers, lookup_continuation, merge_chain, truncate
from .verify import accept, greedy_choice, sample_choice, sample_walk


# A step's plan: which tree the drafter fills this step. (drafter state, deepest allowed depth) -> one Draft per row
Plan = Callable[[DraftState, int], list[Draft]]


@dataclass
class GenerationStats:
    """What one ``generate`` call did. ``accepted_per_depth[d]``: verify steps that accepted depth > d."""

    new_tokens: int = 0
    target_forwards: int = 0
    verify_steps: int = 0
    step_depths: list[int] = field(default_factory=list)  # depth of the tree verified at each step
    tokens_per_step: list[int] = field(default_factory=list)
    nodes_per_step: list[int] = field(default_factory=list)  # tree tokens verified at each step, root included
    accepted_per_depth: list[int] = field(default_factory=list)
    wall_time: float = 0.0
    target_time: float = 0.0  # seconds inside target forwards (prefill + verify)
    prefill_time: float = 0.0  # seconds of the prompt's forward
    tree_nodes: int = 0
    fitted: dict | None = None  # with a tree fitted to the machine: steps per tree, realized speed per bucket

    @property
    def drafted_nodes(self) -> int:
        """Drafted tree nodes verified, summed over steps (roots excluded). Not the server's
        ``spec_decode_num_draft_tokens``, which counts positions drafted ahead (each step's tree depth)."""
        return sum(self.nodes_per_step) - self.verify_steps

    @property
    def mean_accepted_tokens(self) -> float:
        """New tokens per target forward, bonus included (Spec-Bench's "mean accepted tokens")."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of the wall time spent outside target forwards (drafting, verification, bookkeeping)."""
        return 1.0 - self.target_time / self.wall_time if self.wall_time > 0 else 0.0

    def acceptance_rate_per_depth(self) -> list[float]:
        return [n / max(self.verify_steps, 1) for n in self.accepted_per_depth]

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
            "verify_steps": self.verify_steps, "drafted_nodes": self.drafted_nodes, "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_per_depth": self.acceptance_rate_per_depth(), "wall_time": self.wall_time,
            "target_time": self.target_time, "prefill_time": self.prefill_time, "overhead_share": self.overhead_share,
            "tokens_per_second": self.tokens_per_second, "tree_nodes": self.tree_nodes, "fitted": self.fitted,
        }


class _Stopper:
    """Decides, token by token, where plain decoding would have stopped."""

    def __init__(self, prompt: torch.Tensor, config: GenerationConfig, max_new: int,
                 criteria: StoppingCriteriaList | None):
        eos = config.eos_token_id
        self.eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.max_new = max_new
        self.criteria = criteria if criteria else None
        self.ids = prompt.tolist()
        self.prompt_len = len(self.ids)
        self.device = prompt.device

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.max_new - (len(self.ids) - self.prompt_len)

    def extend(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Append ``tokens`` one by one; return (the tokens kept, whether generation is finished)."""
        kept = []
        for tok in tokens:
            self.ids.append(tok)
            kept.append(tok)
            if tok in self.eos or self.remaining <= 0:
                return kept, True
            if self.criteria is not None:
                ids = torch.tensor([self.ids], device=self.device)
                if bool(self.criteria(ids, None).any()):
                    return kept, True
        return kept, False


class StaticTree:
    """A :data:`Plan` over one fixed tree; buffers per depth cap are built once (near ``max_new_tokens`` or
    the context end, shallower trees). ``sampler``: the drafter draws the tokens instead of ranking them."""

    def __init__(self, drafter: Drafter, choices: list[list[int]], device: torch.device, sampler=None):
        self.drafter, self.choices, self.device, self.sampler = drafter, choices, device, sampler
        self.full = build_buffers(choices, device)
        self._by_depth: dict[int, TreeBuffers] = {self.full.depth: self.full}

    def get(self, max_depth: int) -> TreeBuffers:
        depth = max(0, min(max_depth, self.full.depth))
        if depth not in self._by_depth:
            self._by_depth[depth] = build_buffers(truncate(self.choices, depth), self.device)
        return self._by_depth[depth]

    def __call__(self, state: DraftState, max_depth: int) -> list[Draft]:
        return self.drafter.propose(state, self.get(max_depth), max_depth, self.sampler)


class GrownTree:
    """A :data:`Plan` whose tree the drafter grows anew each step within the budget of a :class:`DynamicTree`."""

    def __init__(self, drafter: Drafter, tree: DynamicTree):
        drafter.require_dynamic_trees()
        self.drafter, self.tree = drafter, tree

    def __call__(self, state: DraftState, max_depth: int) -> list[Draft]:
        return self.drafter.propose(state, self.tree, max_depth)


class PromptLookup:
    """A :data:`Plan` that adds a prompt-lookup branch (:func:`medusa_lite.tree.lookup_continuation`) to
    another plan's tree, per row, merged so siblings stay distinct; the tree is then rebuilt for the step."""

    def __init__(self, plan: Plan, tokens: int, ngram: int = 3):
        self.plan, self.tokens, self.ngram = plan, tokens, ngram

    def __call__(self, state: DraftState, max_depth: int) -> list[Draft]:
        return [self._with_branch(draft, ids, max_depth) for draft, ids in zip(self.plan(state, max_depth), state.ids)]

    def _with_branch(self, draft: Draft, ids: torch.Tensor, max_depth: int) -> Draft:
        chain = lookup_continuation(ids, self.ngram, min(self.tokens, max_depth))
        if chain.numel() == 0:
            return draft
        parents, merged = merge_chain(draft.buffers.parents, draft.tokens.tolist(), chain.tolist())
        if len(parents) == len(draft.buffers.parents):  # the drafter had drafted the whole branch already
            return draft
        # the added nodes come last: their proposals are one-hot (Proposals.at)
        return Draft(torch.tensor(merged, dtype=torch.long, device=ids.device), buffers_from_parents(parents, ids.device),
                     draft.proposals)


class FittedPlan:
    """A :data:`Plan` that drafts each step with the tree its context bucket's :class:`~medusa_lite.fit.SpeedGuard`
    names (a ladder fitted to this machine, :func:`medusa_lite.fit.fit_trees`); :meth:`record` (the loop's
    ``on_step``) tells the guard how the step went.

    The tree of a step is chosen before the step drafts, from finished steps only, so the step's
    acceptance (greedy walk or rejection sampling) is exact whatever tree the guard picks.
    """

    def __init__(self, make: Callable[[object], Plan], guards: list, buckets: tuple[int, ...]):
        self.make, self.guards, self.buckets = make, guards, buckets
        self._plans: dict[str, Plan] = {}
        self._bucket = 0
        self.steps_by_tree: dict[str, int] = {}
        self.realized = [[0, 0.0] for _ in guards]  # tokens, seconds per bucket

    def __call__(self, state: DraftState, max_depth: int) -> list[Draft]:
        from .fit import bucket_of, tree_key

        self._bucket = bucket_of(state.ids[0].numel() - 1, self.buckets)  # the cache length (ids end in the root)
        guard = self.guards[self._bucket]
        tree = guard.ladder[guard.rung()].tree
        key = tree_key(tree)
        if key not in self._plans:
            self._plans[key] = self.make(tree)
        self.steps_by_tree[key] = self.steps_by_tree.get(key, 0) + 1
        return self._plans[key](state, max_depth)

    def record(self, tokens: int, seconds: float) -> None:
        self.guards[self._bucket].record(tokens, seconds)
        self.realized[self._bucket][0] += tokens
        self.realized[self._bucket][1] += seconds

    def report(self) -> dict:
        """Steps per tree and realized tokens/s per bucket (speculative steps only, prefill excluded)."""
        return {"steps_by_tree": dict(self.steps_by_tree), "realized": [list(r) for r in self.realized],
                "realized_tokens_per_second": [t / s if s > 0 else None for t, s in self.realized]}


def cache_kwarg(target) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; older models ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _prefill_kwargs(target) -> dict:
    """``logits_to_keep=1`` for prefill where the target supports it (saves a [L, V] logits tensor)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


def _forward(target, stats: GenerationStats, cache_arg: dict, **kwargs):
    t0 = time.perf_counter()
    kwargs.update(cache_arg)
    out = target(use_cache=True, output_hidden_states=True, return_dict=True, **kwargs)
    stats.target_time += time.perf_counter() - t0
    stats.target_forwards += 1
    return out


def verify_forward(target, stats: GenerationStats, cache_arg: dict, tokens: torch.Tensor, buffers: TreeBuffers,
                   cache_len: int, kernels=None):
    """One target forward over every tree node: tree attention mask, positions ``cache_len + depth``.

    tokens: [N] node tokens. The cache grows by N entries (compact it with ``cache.keep_accepted``). Sliding-window
    layers get their own mask (``cache.tree_attention_mask``).
    ``kernels``: a :class:`medusa_lite.kernels.VerifyKernels` (packed GEMM for the sizes where it is faster).
    """
    dtype = target.get_output_embeddings().weight.dtype
    with kernels.context(tokens.numel()) if kernels is not None else contextlib.nullcontext():
        return _forward(target, stats, cache_arg, input_ids=tokens[None],
                        position_ids=(cache_len + buffers.depths)[None],
                        attention_mask=tree_attention_mask(next(iter(cache_arg.values())), buffers, cache_len, dtype))


def context_length(config) -> int | None:
    """The target's maximum number of positions, if its config states one."""
    config = text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@torch.no_grad()
def speculative_generate(
    target,
    drafter: Drafter,
    plan: Plan,
    prompt: torch.Tensor,
    config: GenerationConfig,
    *,
    max_new_tokens: int,
    streamer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[int, float], None] | None = None,
    kernels=None,
) -> tuple[torch.Tensor, GenerationStats]:
    """Generate after ``prompt`` ([L] long, no padding) with ``drafter`` filling the tree ``plan`` picks each
    step. Returns (new tokens [n] long, stats).

    ``on_step(tokens, seconds)``: called after every verify step with the tokens it emitted (accepted +
    bonus) and its wall time (drafting, verification, cache commit): how a fitted drafter's guard learns.
    ``kernels``: :class:`medusa_lite.kernels.VerifyKernels` for the verify forwards (None: the stock kernels).
    """
    start = time.perf_counter()
    stats = GenerationStats()
    device = prompt.device
    warpers = build_warpers(config)

    def choose(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
        if not config.do_sample:
            return greedy_choice(logits)
        return sample_choice(target_probs(logits, warpers), generator)

    stopper = _Stopper(prompt, config, max_new_tokens, stopping_criteria)
    limit = context_length(target.config)
    cache = new_cache(target)
    cache_arg = {cache_kwarg(target): cache}

    out = _forward(target, stats, cache_arg, input_ids=prompt[None], **_prefill_kwargs(target))
    stats.prefill_time = stats.target_time
    root = choose(out.logits[0, -1:])[0]
    cache_len = prompt.numel()
    kept, done = stopper.extend([int(root)])
    state = drafter.start([torch.tensor(stopper.ids, device=device)], _read(out, drafter))
    _push(streamer, kept)

    while not done:
        step_start = time.perf_counter()
        max_depth = stopper.remaining - 1
        if limit is not None:
            max_depth = min(max_depth, limit - cache_len - 1)
        (tokens, buffers, proposals), = plan(state, max_depth)  # [N], root first (batch size 1)
        out = verify_forward(target, stats, cache_arg, tokens, buffers, cache_len, kernels)
        if config.do_sample:
            logits = out.logits[0]  # [N, V]; only the walked nodes' rows are processed

            def target_at(node: int) -> torch.Tensor:
                return target_probs(logits[node: node + 1], warpers)[0].double()

            nodes, root = sample_walk(tokens, buffers.parents, target_at, proposals, generator)  # [a+1], []
        else:
            nodes, root = accept(tokens, greedy_choice(out.logits[0]), buffers.paths)  # [a+1], []
        keep_accepted(cache, cache_len, nodes)
        cache_len += nodes.numel()
        _record(stats, nodes.numel() - 1, buffers)
        kept, done = stopper.extend(tokens[nodes[1:]].tolist() + [int(root)])
        if not done:
            drafter.commit(state, [nodes], _read(out, drafter), [torch.tensor(stopper.ids, device=device)])
        if on_step is not None:
            on_step(nodes.numel(), time.perf_counter() - step_start)
        _push(streamer, kept)

    new = torch.tensor(stopper.generated, dtype=torch.long, device=device)
    stats.new_tokens = new.numel()
    stats.wall_time = time.perf_counter() - start
    return new, stats


def _read(out, drafter: Drafter) -> torch.Tensor:
    """The target features the drafter reads: its ``hidden_layers`` concatenated, [B, T, F]."""
    return drafter_features(out.hidden_states, drafter.hidden_layers)


def _record(stats: GenerationStats, accepted: int, buffers: TreeBuffers) -> None:
    stats.verify_steps += 1
    stats.step_depths.append(buffers.depth)
    stats.tokens_per_step.append(accepted + 1)
    stats.nodes_per_step.append(buffers.num_nodes)
    stats.tree_nodes = max(stats.tree_nodes, buffers.num_nodes)
    while len(stats.accepted_per_depth) < buffers.depth:
        stats.accepted_per_depth.append(0)
    for d in range(accepted):
        stats.accepted_per_depth[d] += 1


def _push(streamer, tokens: list[int]) -> None:
    if streamer is not None and tokens:
        streamer.put(torch.tensor([tokens]))
