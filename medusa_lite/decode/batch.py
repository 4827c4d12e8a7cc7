"""The speculative loop: draft a tree, verify it in one target forward, keep the accepted path.

The engine sees token ids only. Per step: the root (the token already chosen, not yet in the cache)
and the heads' proposals form a tree; one target forward scores every node; the target's choice at
every node (argmax or one draw) decides the accepted path; the cache keeps that path; the bonus
token (the choice at the last accepted node) becomes the next root. Many rows step together
(:class:`SpeculativeBatch`); one ``generate`` is a batch of one (:func:`speculative_generate`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from .._hf import cache_kwarg, context_length
from ..kv import (attention_layout, compact_rows, join_rows, keep_accepted, keep_accepted_rows,
                  new_cache, rows_cache, select_rows)
from ..drafters import Draft, Drafter, DraftState
from ..kernels import Kernels
from .forward import prefill, prefill_rows, read_features, verify_forward, verify_rows
from .plans import BatchPlanner, Plan, draft_rows, first_nodes
from .sequence import GenerationStats, Sequence, record_step


COMPACT_SLACK = 32  # slots per row compacting must free before the batch's cache is compacted (plus a quarter)
PREFILL_TOKENS = 256  # padded prompt tokens per prefill forward of several prompts (rows x longest prompt)


class SpeculativeBatch:
    """Speculative decoding of many sequences at once, rows joining and leaving between steps (continuous batching).

    Each :meth:`step` drafts every row's tree (its own plan, its own depth cap) and verifies all of them in one
    target forward of B x N tokens; acceptance, stopping, streaming and the cache commit are per row. Rows
    advance by different amounts, so the shared cache has holes (see the batch functions of
    :mod:`medusa_lite.kv.rows`): each row has its own positions and attention mask, and the holes are closed
    when they exceed a quarter of the slots (:func:`~medusa_lite.kv.compact_rows`). A row alone in the batch
    with no holes takes exactly the batch-1 path (packed verify kernels). Sliding-window layers keep every key in a
    batch (:func:`~medusa_lite.kv.rows_cache`) and get each row's window from the mask; a ``solo`` batch (one row at a
    time: ``generate`` of one sequence) keeps only their window, as transformers does, and takes the batch-1 path.

    Exact per row: a row's greedy output is its batch-1 output (up to floating-point ties between the batched
    and the single-row matmuls), and its sampled output has the target's distribution: the tree of a row's step
    is decided before the step drafts (by the batch size and finished steps), never by that step's draws.
    """

    def __init__(self, target, drafter: Drafter, kernels: Kernels | None = None, max_step_tokens: int | None = None,
                 guards: BatchPlanner | None = None, solo: bool = False):
        self.target, self.drafter = target, drafter
        self.kernels = kernels if kernels is not None else Kernels.defaults(target)  # the fit's, else unfitted
        self.guards = guards  # e.g. BatchGuards (medusa_lite.fit): the tree of steps with B > 1 rows (None: each row's own plan)
        self.max_step_tokens = max_step_tokens  # tree tokens one verify forward may hold, all rows together
        self.rows: list[Sequence] = []
        self.cache = None
        self.valid: torch.Tensor | None = None  # [B, S] bool: the cache slots each row attends to
        self.state: DraftState | None = None
        self.limit = context_length(target.config)
        self.cache_key = cache_kwarg(target)
        self.solo = solo
        self.layout = attention_layout(target)  # its windowed layers: the masks of a verify pass
        # rows sharing steps: windowed layers keep every key, the mask cuts each row's window (None: the layers do)
        self.window = None if solo else self.layout.window

    def __len__(self) -> int:
        return len(self.rows)

    @contextlib.contextmanager
    def held(self):
        """The kernels set up once for the whole block (:meth:`medusa_lite.kernels.Kernels.held`), so that a loop of
        steps does not set them up and tear them down at every forward."""
        with self.kernels.held(self.target):
            yield self

    @torch.no_grad()
    def add(self, seq: Sequence) -> bool:
        """Prefill ``seq``'s prompt (a forward of its own) and let it join the batch for the next step. False when it
        finished at its first token (or its streamer raised): it does not join, and is finished."""
        return self.add_group([seq])[0]

    def _fresh_cache(self):
        return new_cache(self.target) if self.window is None else rows_cache(self.target)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple:
        """The prompt's forward into a fresh cache: (output, cache, seconds), for :meth:`add_group`'s ``prefilled``."""
        cache = self._fresh_cache()
        out, seconds = prefill(self.target, prompt, {self.cache_key: cache}, self.kernels)
        return out, cache, seconds

    @torch.no_grad()
    def add_group(self, seqs: list[Sequence], prefilled: tuple | None = None) -> list[bool]:
        """Sequences with one and the same prompt (e.g. ``num_return_sequences`` samples of it) share one prefill
        forward: each chooses its first token from the prompt's logits (its own draw when sampling), and the
        prompt's cache row is copied for each. ``prefilled``: the prompt's :meth:`prefill`, done already (its
        cache is taken over). Per sequence: whether it joined (False: finished already)."""
        _check_group(seqs)
        if self.solo and (self.rows or len(seqs) > 1):
            raise ValueError("a solo SpeculativeBatch decodes one sequence")
        out, cache, seconds = prefilled if prefilled is not None else self.prefill(seqs[0].prompt)
        valid = torch.ones(1, seqs[0].prompt.numel(), dtype=torch.bool, device=seqs[0].prompt.device)
        return self._admit([seqs], out, cache, valid, seconds)[0]

    @torch.no_grad()
    def add_prompts(self, groups: list[list[Sequence]]) -> list[list[bool]]:
        """Several prompts joining at once, each a group of sequences as :meth:`add_group` takes them, prefilled in one
        forward of all the prompts (left-padded, each row at its own positions: :func:`~.forward.prefill_rows`).
        Per group, per sequence: whether it joined. Each row's output is what it would be joining alone, up to
        floating-point ties between the batched and the single-row matmuls (as for batched verify steps)."""
        if len(groups) == 1:
            return [self.add_group(groups[0])]
        if self.solo:
            raise ValueError("a solo SpeculativeBatch decodes one sequence")
        for seqs in groups:
            _check_group(seqs)
        cache = self._fresh_cache()
        out, valid, seconds = prefill_rows(self.target, [seqs[0].prompt for seqs in groups], {self.cache_key: cache},
                                           self.kernels)
        return self._admit(groups, out, cache, valid, seconds)

    def _admit(self, groups: list[list[Sequence]], out, cache, valid: torch.Tensor, seconds: float) -> list[list[bool]]:
        """Prefilled groups join: row g of ``out`` / ``cache`` / ``valid`` [G, L] is group g's prompt, left-padded.
        Each sequence chooses its first token; those not finished by it join with a copy of their prompt's row."""
        features = read_features(out, self.drafter)  # [G, L, F]
        prompt_rows, states, staying = [], [], []
        for g, seqs in enumerate(groups):
            length = seqs[0].prompt.numel()
            joining = [seq for seq in seqs if self._first_token(seq, out.logits[g, -1:], length, seconds)]
            if joining:
                prompt_rows += [g] * len(joining)
                states.append(self.drafter.start([seq.ids() for seq in joining],
                                                 features[g:g + 1, -length:].expand(len(joining), -1, -1)))
                staying += joining
        if staying:
            if prompt_rows != list(range(len(groups))):  # one copy of a prompt's row per sequence
                valid = select_rows(cache, valid, torch.tensor(prompt_rows, device=valid.device))
            state = functools.reduce(DraftState.join, states)
            if self.rows:
                self.valid = join_rows(self.cache, self.valid, cache, valid)
                self.state = self.state.join(state)
            else:
                self.cache, self.valid, self.state = cache, valid, state
            self.rows.extend(staying)
        return [[not seq.done for seq in seqs] for seqs in groups]

    @staticmethod
    def _first_token(seq: Sequence, logits: torch.Tensor, prompt_len: int, seconds: float) -> bool:
        """The sequence's first token, chosen from its prompt's last logits [1, V]; whether it goes on (else finished)."""
        seq.stats.prefill_time = seconds
        seq.stats.target_time += seconds
        seq.stats.target_forwards += 1
        seq.cache_len = prompt_len
        seq.extend([int(seq.choose(logits)[0])], logits)
        if seq.done:
            seq.finish()
        return not seq.done

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One step for every row: draft, one verify forward, accept, commit. Returns the rows that finished (their
        stopping rules, or ``error`` set by their streamer); they have left the batch."""
        start = time.perf_counter()
        batch = len(self.rows)
        tree = None  # decided by finished steps only, before any row drafts
        if batch > 1 and self.guards is not None:
            tree = self.guards.tree(batch, max(seq.cache_len for seq in self.rows))
        drafts = self._draft(tree)
        out, seconds = self._verify(drafts)
        results = [seq.accept(draft, out.logits[b, :draft.tokens.numel()])
                   for b, (seq, draft) in enumerate(zip(self.rows, drafts))]
        self._keep([nodes for nodes, _ in results])
        staying = []
        for b, (seq, draft, (nodes, root)) in enumerate(zip(self.rows, drafts, results)):
            seq.cache_len += nodes.numel()
            seq.stats.target_time += seconds
            seq.stats.target_forwards += 1
            record_step(seq.stats, nodes.numel() - 1, draft.buffers)
            seq.extend(draft.tokens[nodes[1:]].tolist() + [int(root)], out.logits[b, nodes])  # token i from node i
            if not seq.done:
                staying.append(b)
        finished = [seq for seq in self.rows if seq.done]
        alone = self.rows[0] if batch == 1 else None
        if staying:
            features = read_features(out, self.drafter)
            index = torch.tensor(staying, device=features.device)
            accepted = [results[b][0] for b in staying]
            self._keep_rows(staying)
            with self.kernels.drafting():
                self.drafter.commit(self.state, accepted, features.index_select(0, index), [s.ids() for s in self.rows])
            self._compact()
        else:
            self._keep_rows([])
        if alone is not None and alone.on_step is not None:  # a fitted plan's guard learns from steps verified alone
            alone.on_step(int(results[0][0].numel()), time.perf_counter() - start)
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
    def _draft(self, tree) -> list[Draft]:
        """Every row's draft for this step, by its own plan and depth cap; rows whose plans agree (e.g. greedy rows
        given the same tree) are drafted together (:func:`~.plans.draft_rows`); a constrained row's cut to its grammar
        (:meth:`Sequence.constrain`)."""
        plans = [seq.plan_for(tree) if tree is not None and seq.plan_for is not None else seq.plan for seq in self.rows]
        with self.kernels.drafting():
            drafts = draft_rows(plans, self.state, [self._max_depth(seq) for seq in self.rows])
        if self.max_step_tokens is not None:
            drafts = [first_nodes(draft, max(1, self.max_step_tokens // len(self.rows))) for draft in drafts]
        # a row with a grammar verifies only the nodes it allows, plus the tokens it forces
        return [seq.constrain(draft, self._max_depth(seq)) for seq, draft in zip(self.rows, drafts)]

    def _max_depth(self, seq: Sequence) -> int:
        """The deepest tree ``seq`` may verify: no more tokens than it has left, no position past the context."""
        max_depth = seq.stopper.remaining - 1
        return max_depth if self.limit is None else min(max_depth, self.limit - seq.cache_len - 1)

    def _verify(self, drafts: list[Draft]):
        """One target forward over every row's tree: (output, seconds)."""
        cache_arg = {self.cache_key: self.cache}
        if len(drafts) == 1 and self.window is None and bool(self.valid.all()):  # the batch-1 path (packed kernels)
            (tokens, buffers, _), = drafts
            return verify_forward(self.target, cache_arg, tokens, buffers, self.rows[0].cache_len, self.kernels,
                                  self.layout)
        # (only a batch of rows gets here: a solo batch holds one row without holes)
        return verify_rows(self.target, cache_arg, drafts, [seq.cache_len for seq in self.rows], self.valid, self.kernels,
                           self.layout)

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
        """Close the holes when that frees enough slots: compacting keeps each row's held slots and cuts every row to
        the longest row's count, so the left padding of shorter rows stays (counting it as freeable compacted a
        batch of unequal prompts on every step, each time a copy of the whole cache for nothing)."""
        if not self.rows:
            return
        slots = self.valid.shape[1]
        needed = int(self.valid.sum(dim=1).max())  # slots per row after compacting
        if needed < slots and (len(self.rows) == 1 or slots > 1.25 * needed + COMPACT_SLACK):
            self.valid = compact_rows(self.cache, self.valid)


def _check_group(seqs: list[Sequence]) -> None:
    prompt = seqs[0].prompt
    if any(not torch.equal(seq.prompt, prompt) for seq in seqs[1:]):
        raise ValueError("add_group: the sequences' prompts differ")


def prefill_chunks(groups: list[list[Sequence]], budget: int = PREFILL_TOKENS) -> list[list[list[Sequence]]]:
    """Consecutive groups (one prompt each) in chunks of at most ``budget`` padded prompt tokens (prompts x the
    longest), each chunk one prefill forward (:meth:`SpeculativeBatch.add_prompts`); a longer prompt is a chunk alone."""
    chunks: list[list[list[Sequence]]] = []
    width = 0
    for group in groups:
        length = group[0].prompt.numel()
        if chunks and (len(chunks[-1]) + 1) * max(width, length) <= budget:
            chunks[-1].append(group)
            width = max(width, length)
        else:
            chunks.append([group])
            width = length
    return chunks


def same_prompt_groups(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Consecutive sequences with the same prompt grouped (they share its prefill)."""
    groups: list[list[Sequence]] = []
    for seq in seqs:
        if groups and torch.equal(seq.prompt, groups[-1][0].prompt):
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups


def run_batch(batch: SpeculativeBatch, seqs: list[Sequence]) -> None:
    """Decode every sequence to its end in one batch; consecutive sequences with the same prompt share its prefill,
    and the prompts are prefilled several at a time (:func:`prefill_chunks`)."""
    with batch.held():
        for chunk in prefill_chunks(same_prompt_groups(seqs)):
            batch.add_prompts(chunk)
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
    kernels: Kernels | None = None,
) -> tuple[torch.Tensor, GenerationStats]:
    """Generate after ``prompt`` ([L] long, no padding) with ``drafter`` filling the tree ``plan`` picks each
    step: a :class:`SpeculativeBatch` of one row. Returns (new tokens [n] long, stats).

    ``on_step(tokens, seconds)``: after every verify step (see :class:`Sequence`).
    ``kernels``: the :class:`medusa_lite.kernels.Kernels` it decodes with (None: ``Kernels.defaults(target)``).
    """
    seq = Sequence(prompt, config, plan, max_new_tokens, stopping_criteria, generator, streamer, on_step)
    batch = SpeculativeBatch(target, drafter, kernels, solo=True)
    with batch.held():
        if batch.add(seq):
            while batch.rows:
                batch.step()
    if seq.error is not None:
        raise seq.error
    return seq.new_tokens, seq.stats
