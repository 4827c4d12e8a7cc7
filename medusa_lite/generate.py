"""The speculative loop: draft a tree, verify it in one target forward, keep the accepted path.

The engine sees token ids only. Per step: the root (the token already chosen, not yet in the cache)
and the heads' proposals form a tree; one target forward scores every node; the target's choice at
every node (argmax or one draw) decides the accepted path; the cache keeps that path; the bonus
token (the choice at the last accepted node) becomes the next root.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from ._hf import cache_kwarg, context_length, prefill_kwargs
from .cache import (batch_attention_mask, check_batchable, compact_rows, join_rows, keep_accepted, keep_accepted_rows,
                    new_cache, select_rows, tree_attention_mask)
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


def verify_forward(target, stats: GenerationStats | None, cache_arg: dict, tokens: torch.Tensor, buffers: TreeBuffers,
                   cache_len: int, kernels=None):
    """One target forward over every tree node: tree attention mask, positions ``cache_len + depth``.

    tokens: [N] node tokens. The cache grows by N entries (compact it with ``cache.keep_accepted``). Sliding-window
    layers get their own mask (``cache.tree_attention_mask``).
    ``kernels``: a :class:`medusa_lite.kernels.VerifyKernels` (packed GEMM for the sizes where it is faster).
    """
    dtype = target.get_output_embeddings().weight.dtype
    t0 = time.perf_counter()
    with kernels.context(tokens.numel()) if kernels is not None else contextlib.nullcontext():
        out = target(input_ids=tokens[None], position_ids=(cache_len + buffers.depths)[None],
                     attention_mask=tree_attention_mask(next(iter(cache_arg.values())), buffers, cache_len, dtype),
                     use_cache=True, output_hidden_states=True, return_dict=True, **cache_arg)
    if stats is not None:  # (None: the caller times it)
        stats.target_time += time.perf_counter() - t0
        stats.target_forwards += 1
    return out


@dataclass(eq=False)
class Sequence:
    """One row of a :class:`SpeculativeBatch`: a prompt's continuation and how it chooses, stops and streams.

    ``on_step(tokens, seconds)``: called after every step this row was verified alone, with the tokens the step
    emitted (accepted + bonus) and its wall time (drafting, verification, commit): how a fitted plan's guard learns.
    ``plan_for(tree)``: this row's plan of ``tree`` (JSON form), for steps verified together with other rows, whose
    tree the batch's guards choose (:class:`~medusa_lite.fit.BatchGuards`); None: ``plan`` at every step.
    """

    prompt: torch.Tensor                                     # [L] long, no padding
    config: GenerationConfig
    plan: Plan
    max_new_tokens: int
    stopping_criteria: StoppingCriteriaList | None = None
    generator: torch.Generator | None = None
    streamer: object = None
    on_step: Callable[[int, float], None] | None = None
    plan_for: Callable[[object], Plan] | None = None
    tag: object = None                                       # the caller's handle (e.g. the server's request)
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: BaseException | None = None                       # set when its streamer raised (e.g. a cancelled request)
    done: bool = False

    def __post_init__(self) -> None:
        self.started = time.perf_counter()
        self.warpers = build_warpers(self.config)
        self.stopper = _Stopper(self.prompt, self.config, self.max_new_tokens, self.stopping_criteria)
        self.cache_len = 0  # this row's tokens in the target's cache (its next position)

    @property
    def new_tokens(self) -> torch.Tensor:
        return torch.tensor(self.stopper.generated, dtype=torch.long, device=self.prompt.device)

    def ids(self) -> torch.Tensor:
        """Every token so far, ending in the root: [L + generated]."""
        return torch.tensor(self.stopper.ids, dtype=torch.long, device=self.prompt.device)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's token at every row of logits [N, V]: argmax, or one draw from the processed distribution."""
        if not self.config.do_sample:
            return greedy_choice(logits)
        return sample_choice(target_probs(logits, self.warpers), self.generator)

    def accept(self, draft: Draft, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [N, V] at the draft's nodes -> (accepted nodes [a+1] long, root first; bonus token [] long)."""
        tokens, buffers, proposals = draft
        if not self.config.do_sample:
            return accept(tokens, greedy_choice(logits), buffers.paths)

        def target_at(node: int) -> torch.Tensor:  # only the walked nodes' rows are processed
            return target_probs(logits[node: node + 1], self.warpers)[0].double()

        return sample_walk(tokens, buffers.parents, target_at, proposals, self.generator)

    def extend(self, tokens: list[int]) -> None:
        """Append the step's tokens (up to the stopping point) and stream them; a raising streamer ends this row only."""
        kept, self.done = self.stopper.extend(tokens)
        if self.streamer is not None and kept:
            try:
                self.streamer.put(torch.tensor([kept]))
            except Exception as e:  # noqa: BLE001 - the row's owner decides (speculative_generate re-raises)
                self.error, self.done = e, True

    def finish(self) -> None:
        self.done = True
        self.stats.new_tokens = len(self.stopper.generated)
        self.stats.wall_time = time.perf_counter() - self.started
        if isinstance(self.plan, FittedPlan):
            self.stats.fitted = self.plan.report()


def first_nodes(draft: Draft, n: int) -> Draft:
    """The draft's tree cut to its first ``n`` nodes. Nodes come parents first and siblings in rank order, so the cut
    is a tree and every kept sampled node keeps the siblings its proposal was drawn after: exact, and decided by
    the budget alone, never by the drafted tokens."""
    if draft.tokens.numel() <= n:
        return draft
    return Draft(draft.tokens[:n], buffers_from_parents(draft.buffers.parents[:n], draft.tokens.device), draft.proposals)


COMPACT_SLACK = 32  # holes per row tolerated before the batch's cache is compacted (plus a quarter of its slots)


class SpeculativeBatch:
    """Speculative decoding of many sequences at once, rows joining and leaving between steps (continuous batching).

    Each :meth:`step` drafts every row's tree (its own plan, its own depth cap) and verifies all of them in one
    target forward of B x N tokens; acceptance, stopping, streaming and the cache commit are per row. Rows
    advance by different amounts, so the shared cache has holes (see the batch functions of
    :mod:`medusa_lite.cache`): each row has its own positions and attention mask, and the holes are closed
    when they exceed a quarter of the slots (:func:`~medusa_lite.cache.compact_rows`). A row alone in the batch
    with no holes takes exactly the batch-1 path (sliding-window layers, packed verify kernels).

    Exact per row: a row's greedy output is its batch-1 output (up to floating-point ties between the batched
    and the single-row matmuls), and its sampled output has the target's distribution: the tree of a row's step
    is decided before the step drafts (by the batch size and finished steps), never by that step's draws.
    """

    def __init__(self, target, drafter: Drafter, kernels=None, max_step_tokens: int | None = None, guards=None):
        self.target, self.drafter, self.kernels = target, drafter, kernels
        self.guards = guards  # BatchGuards: the tree of steps with B > 1 rows (None: each row's own plan)
        self.max_step_tokens = max_step_tokens  # tree tokens one verify forward may hold, all rows together
        self.rows: list[Sequence] = []
        self.cache = None
        self.valid: torch.Tensor | None = None  # [B, S] bool: the cache slots each row attends to
        self.state: DraftState | None = None
        self.limit = context_length(target.config)
        self.cache_key = cache_kwarg(target)
        self.dtype = target.get_output_embeddings().weight.dtype
        self.batchable = not any(new_cache(target).is_sliding)  # full-attention layers only: rows can share a step

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, seq: Sequence) -> bool:
        """Prefill ``seq``'s prompt (a forward of its own) and let it join the batch for the next step. False when it
        finished at its first token (or its streamer raised): it does not join, and is finished."""
        return self.add_group([seq])[0]

    @torch.no_grad()
    def add_group(self, seqs: list[Sequence]) -> list[bool]:
        """Sequences with one and the same prompt (e.g. ``num_return_sequences`` samples of it) share one prefill
        forward: each chooses its first token from the prompt's logits (its own draw when sampling), and the
        prompt's cache row is copied for each. Per sequence: whether it joined (False: finished already)."""
        prompt = seqs[0].prompt
        if any(not torch.equal(seq.prompt, prompt) for seq in seqs[1:]):
            raise ValueError("add_group: the sequences' prompts differ")
        cache = new_cache(self.target)
        if (self.rows or len(seqs) > 1) and not self.batchable:
            check_batchable(cache)  # raises, naming why
        t0 = time.perf_counter()
        out = self.target(input_ids=prompt[None], use_cache=True, output_hidden_states=True, return_dict=True,
                          **{self.cache_key: cache}, **prefill_kwargs(self.target))
        seconds = time.perf_counter() - t0
        staying = []
        for seq in seqs:
            seq.stats.prefill_time = seconds
            seq.stats.target_time += seconds
            seq.stats.target_forwards += 1
            seq.cache_len = prompt.numel()
            seq.extend([int(seq.choose(out.logits[0, -1:])[0])])
            if seq.done:
                seq.finish()
            else:
                staying.append(seq)
        if not staying:
            return [False] * len(seqs)
        features = _read(out, self.drafter)                                    # [1, L, F]
        state = self.drafter.start([seq.ids() for seq in staying], features.expand(len(staying), -1, -1))
        valid = torch.ones(1, prompt.numel(), dtype=torch.bool, device=prompt.device)
        if len(staying) > 1:  # one copy of the prompt's cache row per sequence
            valid = select_rows(cache, valid, torch.zeros(len(staying), dtype=torch.long, device=prompt.device))
        if self.rows:
            self.valid = join_rows(self.cache, self.valid, cache, valid)
            self.state = self.state.join(state)
        else:
            self.cache, self.valid, self.state = cache, valid, state
        self.rows.extend(staying)
        return [not seq.done for seq in seqs]

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One step for every row: draft, one verify forward, accept, commit. Returns the rows that finished (their
        stopping rules, or ``error`` set by their streamer); they have left the batch."""
        start = time.perf_counter()
        batch = len(self.rows)
        tree = None  # decided by finished steps only, before any row drafts
        if batch > 1 and self.guards is not None:
            tree = self.guards.tree(batch, max(seq.cache_len for seq in self.rows))
        drafts = [self._draft(b, seq, batch, tree) for b, seq in enumerate(self.rows)]
        out, seconds = self._verify(drafts)
        results = [seq.accept(draft, out.logits[b, :draft.tokens.numel()])
                   for b, (seq, draft) in enumerate(zip(self.rows, drafts))]
        self._keep([nodes for nodes, _ in results])
        staying = []
        for b, (seq, draft, (nodes, root)) in enumerate(zip(self.rows, drafts, results)):
            seq.cache_len += nodes.numel()
            seq.stats.target_time += seconds
            seq.stats.target_forwards += 1
            _record(seq.stats, nodes.numel() - 1, draft.buffers)
            seq.extend(draft.tokens[nodes[1:]].tolist() + [int(root)])
            if not seq.done:
                staying.append(b)
        finished = [seq for seq in self.rows if seq.done]
        solo = self.rows[0] if batch == 1 else None
        if staying:
            features = _read(out, self.drafter)
            index = torch.tensor(staying, device=features.device)
            accepted = [results[b][0] for b in staying]
            self._keep_rows(staying)
            self.drafter.commit(self.state, accepted, features.index_select(0, index), [s.ids() for s in self.rows])
            self._compact()
        else:
            self._keep_rows([])
        if solo is not None and solo.on_step is not None:  # a fitted plan's guard learns from steps verified alone
            solo.on_step(int(results[0][0].numel()), time.perf_counter() - start)
        if tree is not None:
            self.guards.record(batch, sum(int(nodes.numel()) for nodes, _ in results), time.perf_counter() - start)
        for seq in finished:
            seq.finish()
        return finished

    def remove(self, seqs: list[Sequence]) -> None:
        """Take ``seqs`` out of the batch now (e.g. cancelled requests); they are finished as they stand."""
        gone = {id(seq) for seq in seqs}
        leaving = [s for s in self.rows if id(s) in gone]
        self._keep_rows([b for b, s in enumerate(self.rows) if id(s) not in gone])
        self._compact()
        for seq in leaving:
            seq.finish()

    # ------------------------------------------------------------------ the pieces of a step
    def _draft(self, b: int, seq: Sequence, batch: int, tree) -> Draft:
        max_depth = seq.stopper.remaining - 1
        if self.limit is not None:
            max_depth = min(max_depth, self.limit - seq.cache_len - 1)
        plan = seq.plan_for(tree) if tree is not None and seq.plan_for is not None else seq.plan
        (draft,) = plan(self.state.rows([b]), max_depth)
        if self.max_step_tokens is not None:
            draft = first_nodes(draft, max(1, self.max_step_tokens // batch))
        return draft

    def _verify(self, drafts: list[Draft]):
        """One target forward over every row's tree: (output, seconds)."""
        cache_arg = {self.cache_key: self.cache}
        t0 = time.perf_counter()
        if len(drafts) == 1 and bool(self.valid.all()):  # the batch-1 path (sliding windows, packed kernels)
            (tokens, buffers, _), = drafts
            out = verify_forward(self.target, None, cache_arg, tokens, buffers, self.rows[0].cache_len, self.kernels)
            return out, time.perf_counter() - t0
        width = max(d.tokens.numel() for d in drafts)
        pad = torch.nn.functional.pad
        tokens = torch.stack([pad(d.tokens, (0, width - d.tokens.numel())) for d in drafts])  # [B, N]
        positions = torch.stack([seq.cache_len + pad(d.buffers.depths, (0, width - d.tokens.numel()))
                                 for seq, d in zip(self.rows, drafts)])  # [B, N] each row's own positions
        mask = batch_attention_mask(self.valid, [d.buffers for d in drafts], width, self.dtype)
        with self.kernels.context(tokens.numel()) if self.kernels is not None else contextlib.nullcontext():
            out = self.target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                              output_hidden_states=True, return_dict=True, **cache_arg)
        return out, time.perf_counter() - t0

    def _keep(self, accepted: list[torch.Tensor]) -> None:
        """Keep each row's accepted nodes in the cache; the step's other nodes are dropped or become holes."""
        prefix = self.valid.shape[1]
        if len(accepted) == 1:
            keep_accepted(self.cache, prefix, accepted[0])
            block = torch.ones(1, accepted[0].numel(), dtype=torch.bool, device=self.valid.device)
        else:
            block = keep_accepted_rows(self.cache, prefix, accepted)
        self.valid = torch.cat([self.valid, block], dim=1)

    def _keep_rows(self, rows: list[int]) -> None:
        if len(rows) == len(self.rows):
            return
        if not rows:
            self.rows, self.cache, self.valid, self.state = [], None, None, None
            return
        self.valid = select_rows(self.cache, self.valid, torch.tensor(rows, device=self.valid.device))
        self.state = self.state.rows(rows)
        self.rows = [self.rows[b] for b in rows]

    def _compact(self) -> None:
        if not self.rows:
            return
        held, slots = int(self.valid.sum()), self.valid.numel()
        if held < slots and (len(self.rows) == 1 or slots > 1.25 * held + COMPACT_SLACK * len(self.rows)):
            self.valid = compact_rows(self.cache, self.valid)


def run_batch(batch: SpeculativeBatch, seqs: list[Sequence]) -> None:
    """Decode every sequence to its end: all in one batch (consecutive sequences with the same prompt share its
    prefill), or one after another where the model cannot batch (sliding-window layers,
    :func:`~medusa_lite.cache.check_batchable`)."""
    if not batch.batchable:
        for seq in seqs:
            batch.add(seq)
            while batch.rows:
                batch.step()
        return
    group: list[Sequence] = []
    for seq in seqs + [None]:
        if group and (seq is None or not torch.equal(seq.prompt, group[0].prompt)):
            batch.add_group(group)
            group = []
        if seq is not None:
            group.append(seq)
    while batch.rows:
        batch.step()


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
    step: a :class:`SpeculativeBatch` of one row. Returns (new tokens [n] long, stats).

    ``on_step(tokens, seconds)``: after every verify step (see :class:`Sequence`).
    ``kernels``: :class:`medusa_lite.kernels.VerifyKernels` for the verify forwards (None: the stock kernels).
    """
    seq = Sequence(prompt, config, plan, max_new_tokens, stopping_criteria, generator, streamer, on_step)
    batch = SpeculativeBatch(target, drafter, kernels)
    if batch.add(seq):
        while batch.rows:
            batch.step()
    if seq.error is not None:
        raise seq.error
    return seq.new_tokens, seq.stats


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
