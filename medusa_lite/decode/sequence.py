"""One decoding row: its statistics, where it stops, how it chooses and accepts tokens, and its stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from ..constraints import GrammarState, masked
from ..drafters import Draft
from ..sampling import Penalties, TargetRows, TokenMasks, build_warpers, masked_logits, penalized_logits, target_probs
from ..tree import TreeBuffers
from ..verify import accept, greedy_choice, sample_choice, sample_walk
from .constrained import WalkTree, constrain, constrained_accept
from .plans import Plan
from .stopping import StopRule, Stopper


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
    finish_reason: str | None = None  # why the row stopped (:class:`~.stopping.Finish`): "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that stopped it (vLLM's stop_reason)

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
            "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
        }


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
    logprobs: int | None = None                              # record emitted tokens' log-probs (+ this many top ones)
    tokenizer: object = None                                 # decodes the row's text for its stop strings
    grammar: GrammarState | None = None                      # what the output must match (medusa_lite.constraints)
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: BaseException | None = None                       # set when its streamer raised (e.g. a cancelled request)
    done: bool = False

    def __post_init__(self) -> None:
        self.started = time.perf_counter()
        self.warpers = build_warpers(self.config)
        self.penalties = Penalties.from_config(self.config)
        self._prompt_seen: torch.Tensor | None = None  # [V] bool, once the vocabulary is known (penalties only)
        rule = StopRule.from_config(self.config, self.max_new_tokens, self.stopping_criteria, self.tokenizer)
        self.stopper = Stopper(self.prompt, rule)
        self.masks = TokenMasks.from_config(self.config, rule.stop_ids)
        self.cache_len = 0  # this row's tokens in the target's cache (its next position)
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per kept token (``logprobs`` set)
        self._walk: WalkTree | None = None  # this step's sampling walk tree, where a grammar cut the draft

    @property
    def new_tokens(self) -> torch.Tensor:
        return torch.tensor(self.stopper.generated, dtype=torch.long, device=self.prompt.device)

    def ids(self) -> torch.Tensor:
        """Every token so far, ending in the root: [L + generated]."""
        return torch.tensor(self.stopper.ids, dtype=torch.long, device=self.prompt.device)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's token at the root from logits [1, V]: argmax, or one draw from the processed distribution."""
        logits = self.processed(logits, self.prompt.new_zeros(1), torch.ones(1, 1, dtype=torch.bool))
        if self.grammar is not None:
            logits = masked(logits, self.grammar.allowed())
        if not self.config.do_sample:
            return greedy_choice(logits)
        return sample_choice(target_probs(logits, self.warpers), self.generator)

    def accept(self, draft: Draft, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [N, V] at the draft's nodes -> (accepted nodes [a+1] long, root first; bonus token [] long)."""
        tokens, buffers, proposals = draft
        logits = self.processed(logits, tokens, buffers.ancestor_mask)
        if self.grammar is not None:
            return constrained_accept(self.grammar, self.stopper.generated, draft, self._walk, logits, self.warpers,
                                      self.generator, self.config.do_sample)
        if not self.config.do_sample:
            return accept(tokens, greedy_choice(logits), buffers.paths)
        return sample_walk(tokens, buffers.parents, TargetRows(logits, self.warpers), proposals, self.generator)

    def constrain(self, draft: Draft, max_depth: int) -> Draft:
        """The draft this row verifies: with a grammar, the nodes it allows and the tokens it forces
        (:func:`~.constrained.constrain`, at most ``max_depth`` deep); else ``draft``."""
        if self.grammar is None:
            return draft
        draft, self._walk = constrain(draft, self.grammar, max_depth)
        return draft

    def processed(self, logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """logits [N, V] at the nodes of a tree (``tokens`` [N], ``ancestors`` [N, N]) after each node's own prefix's
        penalties and masks (:func:`~medusa_lite.sampling.penalized_logits`,
        :func:`~medusa_lite.sampling.masked_logits`), as plain decoding processes them at the step that reaches the node;
        unchanged without either."""
        if self.penalties.active:
            logits = self.penalized(logits, tokens, ancestors)
        if not self.masks.active:
            return logits
        scores = logits.float() if self.penalties.active else logits.float().clone()
        stopper = self.stopper
        return masked_logits(scores, self.masks, stopper.ids, len(stopper.ids) - stopper.prompt_len,
                             tokens.to(scores.device), ancestors.to(scores.device))

    def penalized(self, logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """logits [N, V] after each node's own prefix's penalties (:func:`~medusa_lite.sampling.penalized_logits`)."""
        vocab, device = logits.shape[-1], logits.device
        if self._prompt_seen is None:
            prompt = self.prompt[self.prompt < vocab]  # ids beyond the output vocabulary cannot be penalized
            self._prompt_seen = torch.bincount(prompt, minlength=vocab).to(device) > 0
        output = torch.tensor(self.stopper.generated, dtype=torch.long, device=device)
        counts = torch.bincount(output[output < vocab], minlength=vocab).float()
        return penalized_logits(logits, self.penalties, self._prompt_seen, counts, tokens.to(device),
                                ancestors.to(device))

    def extend(self, tokens: list[int], logits: torch.Tensor) -> None:
        """Append the step's tokens (up to the stopping point) and stream them; a raising streamer ends this row only.
        logits: [len(tokens), V], the target's logits each token was chosen from (for ``logprobs``)."""
        kept, self.done = self.stopper.extend(tokens)
        if self.grammar is not None and not self.done:
            self.grammar.sync(self.stopper.generated)
        if self.logprobs is not None and kept:
            self.token_logprobs += token_logprobs(logits[:len(kept)], kept, self.logprobs)
        if self.streamer is not None and kept:
            try:
                self.streamer.put(torch.tensor([kept]))
            except Exception as e:  # noqa: BLE001 - the row's owner decides (speculative_generate re-raises)
                self.error, self.done = e, True

    def finish(self) -> None:
        self.done = True
        self.stats.new_tokens = len(self.stopper.generated)
        self.stats.wall_time = time.perf_counter() - self.started
        finish = self.stopper.finish
        if finish is not None:
            self.stats.finish_reason, self.stats.stop_reason = finish.reason, finish.stop_reason
        report = getattr(self.plan, "report", None)  # a plan that learns from its steps (the step-report protocol)
        if report is not None:
            self.stats.fitted = report()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per token: its log-probability under the target's own distribution (log-softmax of the raw logits [n, V],
    before temperature and top-k / top-p, as vLLM reports them) and the ``top`` most likely (token, log-prob)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()  # [n]
    best = lp.topk(top, dim=-1) if top > 0 else None
    return [(c, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, c in enumerate(chosen)]


def record_step(stats: GenerationStats, accepted: int, buffers: TreeBuffers) -> None:
    stats.verify_steps += 1
    stats.step_depths.append(buffers.depth)
    stats.tokens_per_step.append(accepted + 1)
    stats.nodes_per_step.append(buffers.num_nodes)
    stats.tree_nodes = max(stats.tree_nodes, buffers.num_nodes)
    while len(stats.accepted_per_depth) < buffers.depth:
        stats.accepted_per_depth.append(0)
    for d in range(accepted):
        stats.accepted_per_depth[d] += 1
