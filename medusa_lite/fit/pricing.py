"""Pricing the candidates on this machine: per context bucket a *ladder* of trees predicted faster than plain
decoding (:func:`fit_trees`, pure), and the fit that holds them (:class:`HardwareFit`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..decode.adaptive import Rung
from ..kernels import Kernels
from ..machine import describe
from ..tree import has_lookup, parse_tree, tree_key, tree_nodes
from .latency import BUCKETS, bucket_contexts, latency_at, max_tokens
from .table import Candidate

PLAIN = []                          # the root alone: plain decoding inside the speculative loop
MAX_RUNGS = 4                       # candidate trees kept per ladder (plus the root alone)
PRICED_BATCHES = (*range(2, 17), 24, 32, 48, 64)  # batch sizes priced ahead for decoding (between two: the smaller)
DRAFT_BATCH = 8                     # rows the probe also times drafting for (a batched step drafts its rows together)


def fit_trees(candidates: list[Candidate], latency: dict[int, dict[int, float]], draft_seconds: dict[str, float],
              overhead: float, buckets=BUCKETS, max_rungs: int = MAX_RUNGS, batch: int = 1,
              draft_batch: dict[str, float] | None = None) -> list[list[Rung]]:
    """Per bucket, the ladder of trees for this machine: the (up to ``max_rungs``) candidates predicted faster
    than plain decoding, fastest first, then the root alone, which is always last.

    ``latency``: measured verify latency (:func:`latency_at`); ``draft_seconds``: drafting time per step by
    :func:`tree_key`; ``overhead``: the loop's per-step bookkeeping (the same for every tree). Candidates
    with more tree tokens than were measured are left out (the probe stops measuring where no candidate
    could pay). Ties go to the smaller tree. Pure: numbers in, ladders out.

    ``batch``: the rungs of ``batch`` rows verified together: B trees of N nodes are one forward of B x N
    tokens (N: the widest tree, every row padded to it), bookkeeping is paid per row, and drafting per row as
    :func:`draft_per_row` interpolates it from one row's (``draft_seconds``) and :data:`DRAFT_BATCH` rows'
    (``draft_batch``; None: one row's, per row). A rung is
    stated per row (tokens per row and step, step seconds / B), so its tokens/s is the batch's total. As the batch grows
    the spare compute a tree spends is used by the other rows, so the ladders shrink toward the root alone.
    """
    limit = max_tokens(latency)
    ladders = []
    for bucket, context in enumerate(bucket_contexts(buckets)):
        plain = Rung(PLAIN, 1.0, latency_at(latency, batch, context) / batch + overhead)
        rungs = []
        for c in candidates:
            if c.tree == PLAIN:
                continue
            tokens, nodes = c.in_bucket(bucket)
            if batch > 1:  # rows are padded to the widest tree of the step: a lookup branch some row fills is paid by all
                nodes = max(nodes, _widest(c.tree))
            if batch * nodes > limit:
                continue
            key = tree_key(c.tree)
            draft = draft_per_row(draft_seconds.get(key, 0.0), (draft_batch or {}).get(key), batch)
            step = latency_at(latency, batch * nodes, context) / batch + draft + overhead
            rung = Rung(c.tree, tokens, step)
            if rung.tokens_per_second > plain.tokens_per_second:
                rungs.append((rung, nodes))
        rungs.sort(key=lambda rn: (-round(rn[0].tokens_per_second, 9), rn[1]))
        ladders.append(_diverse([r for r, _ in rungs], max_rungs) + [plain])
    return ladders


def draft_per_row(one: float, rows: float | None, batch: int) -> float:
    """Drafting seconds per row of a step of ``batch`` rows, linear in the rows between one row's (``one``) and
    :data:`DRAFT_BATCH` rows' (``rows``; None: each row pays ``one``): rows drafted together share the passes over
    the drafter's weights, and each adds its own attention and bookkeeping."""
    if rows is None or batch == 1:
        return one
    extra = max(rows - one, 0.0) / (DRAFT_BATCH - 1)  # each further row
    return (one + (batch - 1) * extra) / batch


def _diverse(rungs: list[Rung], max_rungs: int) -> list[Rung]:
    """The ``max_rungs`` fastest rungs, the last of them the fastest without a prompt-lookup branch where none of
    the others is one: a lookup branch pays on text that repeats itself, far less on text that does not (which
    the guard then learns), and the drafter alone is the rung it falls back to before the root."""
    kept = rungs[:max_rungs]
    own = next((r for r in rungs if not has_lookup(r.tree)), None)
    if own is not None and own not in kept:
        kept = kept[: max_rungs - 1] + [own]
    return kept


def _widest(tree) -> int:
    """Tree tokens (root included) of ``tree`` (JSON form) when every branch is filled (a lookup branch included)."""
    return tree_nodes(parse_tree(tree)) + 1


@dataclass(frozen=True)
class HardwareFit:
    """The trees fitted to this machine: a ladder per context bucket, the kernels to decode them with, and where the
    figures came from."""

    fingerprint: dict
    ladders: list[list[Rung]]
    buckets: tuple[int, ...] = BUCKETS
    cache_hit: bool = False
    probe_seconds: float = 0.0
    packed_from: int = 0     # verify forwards of packed_from .. packed_to tree tokens use the packed path
    packed_to: int = 0       # (medusa_lite.kernels); packed_from 0: the stock kernels throughout
    measured: dict = field(default_factory=dict)  # the probe's latency, draft and overhead (to price batches)
    candidates: list = field(default_factory=list)  # the candidates the ladders were fitted from
    kernels: Kernels | None = field(default=None, compare=False)  # what decoding runs with (None: Kernels.defaults)
    _batch_ladders: dict = field(default_factory=dict, repr=False, compare=False)

    def batch_ladders(self, batch: int) -> list[list[Rung]]:
        """Per context bucket, the ladder for ``batch`` rows verified together, priced by the same latency model
        (:func:`fit_trees` with ``batch``); the fit's own ladders for one row (or a fit without the probe's figures)."""
        if batch == 1 or not self.measured or not self.candidates:
            return self.ladders
        if batch not in self._batch_ladders:
            self._batch_ladders[batch] = fit_trees(self.candidates, self.measured["latency"], self.measured["draft"],
                                                   self.measured["overhead"], self.buckets, batch=batch,
                                                   draft_batch=self.measured.get("draft_batch"))
        return self._batch_ladders[batch]

    def priced_batches(self) -> dict[int, list[list[Rung]]]:
        """The ladders of every batch size in :data:`PRICED_BATCHES`, what :class:`~medusa_lite.decode.BatchGuards`
        walks (priced here, ahead, so that decoding never calls back into the fit)."""
        return {batch: self.batch_ladders(batch) for batch in PRICED_BATCHES}

    def batch_trees(self, batch: int) -> list:
        """Per context bucket, the tree predicted fastest for ``batch`` rows (JSON form; ``[]``: no speculation)."""
        return [ladder[0].tree for ladder in self.batch_ladders(batch)]

    def fallback_tree(self) -> list | dict:
        """The one tree to store for decoding without a fit (``MedusaConfig.tree``): the fitted tree of the context
        bucket the acceptance table measured most steps in (where its figures are surest), JSON form."""
        steps = [sum(c.steps[b] for c in self.candidates) for b in range(len(self.buckets))]
        bucket = max(range(len(self.buckets)), key=lambda b: (steps[b], -b)) if self.candidates else 0
        return self.ladders[bucket][0].tree

    def summary(self) -> dict:
        """JSON-able: machine, and per bucket the fitted tree with its predicted tokens/s and plain decoding's."""
        rows = []
        for lo, hi, ladder in zip(self.buckets, list(self.buckets[1:]) + [None], self.ladders):
            best, plain = ladder[0], ladder[-1]
            rows.append({"context": f"{lo}-{hi - 1}" if hi else f"{lo}+", "tree": best.tree,
                         "predicted_tokens_per_step": best.tokens_per_step,
                         "predicted_tokens_per_second": best.tokens_per_second,
                         "predicted_plain_tokens_per_second": plain.tokens_per_second,
                         "ladder": [r.tree for r in ladder]})
        return {"fingerprint": self.fingerprint, "cache_hit": self.cache_hit, "probe_seconds": self.probe_seconds,
                "packed_verify_from_tokens": self.packed_from, "packed_verify_to_tokens": self.packed_to,
                "buckets": rows}

    def report(self) -> str:
        """The machine and, per context bucket, the fitted tree and its predicted speed (for logs)."""
        lines = [f"machine: {describe(self.fingerprint)}; "
                 + ("fit read from the cache" if self.cache_hit else f"probed in {self.probe_seconds:.1f} s")
                 + (f"; packed GEMM for verify forwards of {self.packed_from}-{self.packed_to} tokens"
                    if self.packed_from else "")]
        for row in self.summary()["buckets"]:
            lines.append(f"  context {row['context']:>9s}: tree {json.dumps(row['tree'])} -> predicted "
                         f"{row['predicted_tokens_per_second']:.1f} tok/s (plain decoding "
                         f"{row['predicted_plain_tokens_per_second']:.1f})")
        return "\n".join(lines)
