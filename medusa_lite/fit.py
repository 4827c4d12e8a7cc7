"""Fit speculation to the machine it runs on: the choice of tree, as pure functions (DESIGN 3.2).

Calibration has two halves:

* **hardware-independent, shipped with the heads** (``acceptance.json``, :class:`AcceptanceTable`): for
  every candidate tree, the tokens per step it yields (accepted + bonus) and the tree tokens it verifies
  per step, in each context-length bucket. Measured once, offline, by ``medusa-lite calibrate`` on the
  target's own continuations (greedy: replayed; sampling: run);
* **hardware-dependent, measured where the model runs** (:mod:`medusa_lite.probe`): the target's
  verify-forward latency against tree tokens and cache length, each candidate's drafting time, and the
  loop's per-step bookkeeping.

:func:`fit_trees` combines them. Per bucket, a candidate's predicted speed is
``tokens_per_step / (latency(nodes, context) + drafting + bookkeeping)``; the root alone (plain decoding
in the loop) is always a candidate, so the fitted tree is never predicted slower than no speculation.
The result per bucket is a *ladder*: the candidates predicted faster than plain decoding, fastest
first, ending with the root alone. :class:`SpeedGuard` walks that ladder while decoding when the
realized speed disagrees with the prediction.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .machine import describe

ACCEPTANCE_NAME = "acceptance.json"
ACCEPTANCE_FORMAT = "medusa_lite.acceptance/1"
BUCKETS = (0, 256, 1024)            # context-length buckets: [0, 256), [256, 1024), [1024, ...)
MIN_BUCKET_STEPS = 20               # fewer replayed steps in a bucket: use the candidate's pooled figures
PLAIN = []                          # the root alone: plain decoding inside the speculative loop
MAX_RUNGS = 4                       # candidate trees kept per ladder (plus the root alone)


def bucket_of(context: int, buckets=BUCKETS) -> int:
    """Index of the bucket holding a cache of ``context`` tokens."""
    index = 0
    for i, lo in enumerate(buckets):
        if context >= lo:
            index = i
    return index


def bucket_contexts(buckets=BUCKETS) -> list[float]:
    """The cache length each bucket's latency is read at: its middle; twice its start for the open last one."""
    bounds = list(buckets[1:])
    return [(lo + hi) / 2 for lo, hi in zip(buckets, bounds)] + [max(2.0 * buckets[-1], 128.0)]


def tree_key(tree) -> str:
    """A stable text key of a tree's JSON form (dict keys sorted)."""
    return json.dumps(tree, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------ the shipped table
@dataclass
class Candidate:
    """One candidate tree's hardware-independent figures, per context bucket."""

    tree: list | dict                  # the tree in JSON form ([] = the root alone)
    tokens_per_step: list[float]       # accepted + bonus per step, per bucket
    nodes: list[float]                 # tree tokens verified per step (root included), per bucket
    steps: list[int]                   # steps measured per bucket (0: no data; pooled figures used)

    def __post_init__(self) -> None:
        n = len(self.steps)
        if not (len(self.tokens_per_step) == len(self.nodes) == n) or n == 0:
            raise ValueError(f"candidate {self.tree!r}: per-bucket lists of different lengths")
        for name in ("tokens_per_step", "nodes"):
            values = getattr(self, name)
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 1.0 for v in values):
                raise ValueError(f"candidate {self.tree!r}: {name} must be finite numbers >= 1, got {values}")

    def in_bucket(self, bucket: int) -> tuple[float, float]:
        """(tokens per step, nodes) in ``bucket``; the step-weighted pool over buckets where it has too few steps."""
        if self.steps[bucket] >= MIN_BUCKET_STEPS:
            return self.tokens_per_step[bucket], self.nodes[bucket]
        total = sum(self.steps)
        if total == 0:
            return sum(self.tokens_per_step) / len(self.steps), sum(self.nodes) / len(self.steps)
        tokens = sum(t * s for t, s in zip(self.tokens_per_step, self.steps)) / total
        nodes = sum(n * s for n, s in zip(self.nodes, self.steps)) / total
        return tokens, nodes


@dataclass
class AcceptanceTable:
    """``acceptance.json``: every candidate tree's tokens per step by context bucket, for greedy decoding and
    for sampling (measured at ``sample_temperature``), with where the figures came from."""

    buckets: list[int]
    greedy: list[Candidate]
    sample: list[Candidate] = field(default_factory=list)
    sample_temperature: float | None = None
    data: dict = field(default_factory=dict)   # provenance: prompts, tokens, date, heads

    def __post_init__(self) -> None:
        if not self.buckets or self.buckets[0] != 0 or sorted(set(self.buckets)) != list(self.buckets):
            raise ValueError(f"acceptance buckets must start at 0 and increase, got {self.buckets}")
        for c in self.greedy + self.sample:
            if len(c.steps) != len(self.buckets):
                raise ValueError(f"candidate {c.tree!r} has {len(c.steps)} buckets, the table {len(self.buckets)}")

    def candidates(self, sample: bool) -> list[Candidate]:
        """The candidates for sampling (greedy ones if the table has none) or for greedy decoding."""
        return (self.sample or self.greedy) if sample else self.greedy

    def to_dict(self) -> dict:
        return {"format": ACCEPTANCE_FORMAT, "buckets": list(self.buckets),
                "greedy": [asdict(c) for c in self.greedy], "sample": [asdict(c) for c in self.sample],
                "sample_temperature": self.sample_temperature, "data": self.data}

    @classmethod
    def from_dict(cls, data: dict, source: str = "acceptance table") -> "AcceptanceTable":
        if not isinstance(data, dict) or data.get("format") != ACCEPTANCE_FORMAT:
            raise ValueError(f"{source}: not a {ACCEPTANCE_FORMAT} file")
        try:
            return cls(buckets=list(data["buckets"]), greedy=[Candidate(**c) for c in data["greedy"]],
                       sample=[Candidate(**c) for c in data.get("sample", [])],
                       sample_temperature=data.get("sample_temperature"), data=dict(data.get("data", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: malformed acceptance table: {e}") from e

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / ACCEPTANCE_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "AcceptanceTable | None":
        """The table in ``directory``, or None when it has none."""
        path = Path(directory) / ACCEPTANCE_NAME
        if not path.is_file():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()), str(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


# ----------------------------------------------------------------------------------- latency model
def latency_at(latency: dict[int, dict[int, float]], tokens: float, context: float) -> float:
    """Seconds of one verify forward of ``tokens`` tree tokens over a cache of ``context`` tokens.

    latency: ``{cache_len: {tokens: seconds}}`` as measured. Within one cache length: piecewise linear in
    tokens (made non-decreasing, flat below the smallest point, extended by the last slope above the
    largest); across cache lengths: linear in the cache length (attention grows with it), never below the
    smallest measured cache length's value and never decreasing with context.
    """
    from .calibration import interpolate_latency, monotone_latency

    if not latency:
        raise ValueError("empty latency table")
    at, highest = {}, 0.0
    for c, table in sorted(latency.items()):  # never decreasing with context: a running maximum
        highest = max(highest, interpolate_latency(monotone_latency(table), tokens))
        at[c] = highest
    lengths = sorted(at)
    if len(lengths) == 1 or context <= lengths[0]:
        return at[lengths[0]]
    lo, hi = (lengths[-2], lengths[-1]) if context >= lengths[-1] else next(
        (a, b) for a, b in zip(lengths, lengths[1:]) if a <= context <= b)
    slope = max((at[hi] - at[lo]) / (hi - lo), 0.0)
    return at[lo] + slope * (context - lo)


def max_tokens(latency: dict[int, dict[int, float]]) -> int:
    """The largest number of tree tokens measured at the shortest cache length, which the probe measures at every
    size (longer cache lengths at a few sizes, extrapolated in tokens); no candidate beyond it is priced."""
    return max(latency[min(latency)])


# ------------------------------------------------------------------------------------- the choice
@dataclass
class Rung:
    """One tree of a bucket's ladder and its prediction on this machine."""

    tree: list | dict
    tokens_per_step: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def fit_trees(candidates: list[Candidate], latency: dict[int, dict[int, float]], draft_seconds: dict[str, float],
              overhead: float, buckets=BUCKETS, max_rungs: int = MAX_RUNGS, batch: int = 1) -> list[list[Rung]]:
    """Per bucket, the ladder of trees for this machine: the (up to ``max_rungs``) candidates predicted faster
    than plain decoding, fastest first, then the root alone, which is always last.

    ``latency``: measured verify latency (:func:`latency_at`); ``draft_seconds``: drafting time per step by
    :func:`tree_key`; ``overhead``: the loop's per-step bookkeeping (the same for every tree). Candidates
    with more tree tokens than were measured are left out (the probe stops measuring where no candidate
    could pay). Ties go to the smaller tree. Pure: numbers in, ladders out.

    ``batch``: the rungs of ``batch`` rows verified together: B trees of N nodes are one forward of B x N
    tokens (N: the widest tree, every row padded to it), drafting and bookkeeping are paid per row. A rung is
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
            step = latency_at(latency, batch * nodes, context) / batch + draft_seconds.get(tree_key(c.tree), 0.0) + overhead
            rung = Rung(c.tree, tokens, step)
            if rung.tokens_per_second > plain.tokens_per_second:
                rungs.append((rung, nodes))
        rungs.sort(key=lambda rn: (-round(rn[0].tokens_per_second, 9), rn[1]))
        ladders.append([r for r, _ in rungs[:max_rungs]] + [plain])
    return ladders


def _widest(tree) -> int:
    """Tree tokens (root included) of ``tree`` (JSON form) when every branch is filled (a lookup branch included)."""
    from .tree import parse_tree, tree_nodes

    return tree_nodes(parse_tree(tree)) + 1


# -------------------------------------------------------------------------------- the online guard
class SpeedGuard:
    """Checks a bucket's ladder against realized speed while decoding and moves along it.

    Starts on the first rung (the fitted tree). After ``window`` steps on a rung, its realized tokens/s
    (tokens emitted / wall seconds of those steps) is compared with every rung below it: with a rung's own
    realized speed when it was measured recently, else with its prediction corrected by what the current
    rung showed, both in time (steps running slower than predicted: a busy machine) and in acceptance
    (fewer drafted tokens accepted than the table says: harder text than the calibration's). The guard
    moves to the fastest of them, down to the root alone (no speculation). After ``retry`` steps below the
    top it tries one rung up again, for ``window`` steps, so a tree that stopped paying for a while is
    picked up again when it pays; a try that fails doubles the wait before the next one (up to
    ``max_retry``), one that holds resets it, so text where no tree pays costs little exploring.

    Exactness: :meth:`rung` depends only on steps already finished (their token counts and durations),
    never on the draws of the step it is asked for. A step's tree is therefore fixed before that step
    drafts, and every acceptance rule (greedy walk, rejection sampling) is exact whatever tree it gets.
    """

    def __init__(self, ladder: list[Rung], window: int = 8, retry: int = 64, max_retry: int = 1024):
        if not ladder:
            raise ValueError("a ladder needs at least one rung")
        self.ladder = ladder
        self.window, self.retry, self.max_retry = window, retry, max_retry
        self.wait = retry                                      # steps below the top before the next try up
        self.trying = False                                    # on a rung reached by a try, window not done
        self.level = 0
        self.recent = [deque(maxlen=window) for _ in ladder]  # (tokens, seconds) of the last steps per rung
        self.age = [math.inf for _ in ladder]                  # steps since a rung's figures were taken
        self.below_top = 0                                     # steps since the last move

    def rung(self) -> int:
        """The rung for the next step (decided by past steps only)."""
        return self.level

    def realized(self, level: int) -> float | None:
        """Tokens/s of the last ``window`` steps on ``level``, if it has that many."""
        steps = self.recent[level]
        if len(steps) < self.window:
            return None
        return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-12)

    def record(self, tokens: int, seconds: float) -> None:
        """A finished step on the current rung: ``tokens`` emitted in ``seconds`` (draft + verify + commit)."""
        level = self.level
        self.recent[level].append((tokens, seconds))
        self.age = [a + 1 for a in self.age]
        self.age[level] = 0
        speed = self.realized(level)
        if speed is not None:
            best, best_speed = level, speed
            for other in range(level + 1, len(self.ladder)):
                estimate = self.estimate(other, level)
                if estimate > best_speed:
                    best, best_speed = other, estimate
            if best != level:
                if self.trying:  # the try failed: wait longer before the next
                    self.wait = min(2 * self.wait, self.max_retry)
                self.trying = False
                self._move(best)
                return
            if self.trying:  # the try held for a window
                self.wait, self.trying = self.retry, False
        if level > 0:
            self.below_top += 1
            if self.below_top >= self.wait:
                self._move(level - 1)
                self.trying = True

    def estimate(self, level: int, measured: int) -> float:
        """Tokens/s expected of ``level``: realized if fresh, else its prediction corrected by the ``measured``
        rung's realized step time (time factor) and realized drafted tokens per step (acceptance factor)."""
        fresh = self.realized(level)
        if fresh is not None and self.age[level] <= self.wait + self.window:
            return fresh
        steps, seen = self.recent[measured], self.ladder[measured]
        slowdown = (sum(s for _, s in steps) / len(steps)) / seen.step_seconds
        drafted = sum(t for t, _ in steps) / len(steps) - 1.0  # accepted drafted tokens per step
        acceptance = min(drafted / (seen.tokens_per_step - 1.0), 1.0) if seen.tokens_per_step > 1.0 else 1.0
        rung = self.ladder[level]
        return (1.0 + max(acceptance, 0.0) * (rung.tokens_per_step - 1.0)) / (rung.step_seconds * slowdown)

    def _move(self, level: int) -> None:
        self.level = level
        self.recent[level].clear()
        self.below_top = 0


class CyclingGuard(SpeedGuard):
    """A guard that moves one rung down after every step, wrapping around: every tree of the ladder in turn,
    whatever the timings. For tests of exactness across tree changes (a choice that depends on the past only)."""

    def record(self, tokens: int, seconds: float) -> None:
        self.level = (self.level + 1) % len(self.ladder)


class BatchGuards:
    """The tree of steps that verify B > 1 rows together: per (batch size, context bucket) the ladder
    :meth:`HardwareFit.batch_ladders` prices, walked by its own guard (``guard(ladder)``, a :class:`SpeedGuard`)
    on the realized speed of those steps (per row: tokens emitted by all rows / B, step seconds / B).

    The batch size changes whenever a request joins or leaves, so what one guard learned is shared: the
    drafted tokens accepted per step on tree rungs, against what their ladders predicted (the last
    ``window`` such steps of any batch size). A guard created later starts on the rung that ratio predicts
    fastest instead of re-learning from the top (on chat text the shipped table's lookup branches are
    accepted far less than on the calibration's).

    Exactness as for one row: :meth:`tree` depends only on finished steps, so a step's tree is fixed before
    any row drafts it."""

    def __init__(self, fit: "HardwareFit", guard=None, window: int = 32):
        self.fit, self.guard = fit, guard or SpeedGuard
        self._guards: dict[tuple[int, int], SpeedGuard] = {}
        self._last: SpeedGuard | None = None
        self._drafted: deque = deque(maxlen=window)  # (predicted, realized) drafted tokens per row, tree rungs

    def tree(self, batch: int, context: int):
        """The tree (JSON form) for the next step of ``batch`` rows whose longest cache holds ``context`` tokens."""
        key = (batch, bucket_of(context, self.fit.buckets))
        if key not in self._guards:
            guard = self._guards[key] = self.guard(self.fit.batch_ladders(batch)[key[1]])
            if self._drafted:
                guard._move(self._best_start(guard.ladder))
        self._last = self._guards[key]
        return self._last.ladder[self._last.rung()].tree

    def _best_start(self, ladder: list[Rung]) -> int:
        predicted = sum(p for p, _ in self._drafted)
        acceptance = max(sum(r for _, r in self._drafted), 0.0) / predicted if predicted > 0 else 1.0
        speeds = [(1.0 + acceptance * (r.tokens_per_step - 1.0)) / r.step_seconds for r in ladder]
        return max(range(len(ladder)), key=lambda i: (round(speeds[i], 9), -i))

    def record(self, batch: int, tokens: int, seconds: float) -> None:
        """The step :meth:`tree` was last asked for emitted ``tokens`` (all ``batch`` rows) in ``seconds``; the
        guard sees it per row, as its ladder states it."""
        guard = self._last
        if guard is None:
            return
        rung = guard.ladder[guard.rung()]
        if rung.tokens_per_step > 1.0:
            self._drafted.append((rung.tokens_per_step - 1.0, tokens / batch - 1.0))
        guard.record(tokens / batch, seconds / batch)


@dataclass
class HardwareFit:
    """The trees fitted to this machine: a ladder per context bucket, and where the figures came from."""

    fingerprint: dict
    ladders: list[list[Rung]]
    buckets: tuple[int, ...] = BUCKETS
    cache_hit: bool = False
    probe_seconds: float = 0.0
    packed_from: int = 0     # verify forwards of this many tree tokens and more (up to the packed rows) use
                             # prepacked GEMM (medusa_lite.kernels); 0: the stock kernels throughout
    measured: dict = field(default_factory=dict)  # the probe's latency, draft and overhead (to price batches)
    candidates: list = field(default_factory=list)  # the candidates the ladders were fitted from
    _batch_ladders: dict = field(default_factory=dict, repr=False, compare=False)

    def batch_ladders(self, batch: int) -> list[list[Rung]]:
        """Per context bucket, the ladder for ``batch`` rows verified together, priced by the same latency model
        (:func:`fit_trees` with ``batch``); the fit's own ladders for one row (or a fit without the probe's figures)."""
        if batch == 1 or not self.measured or not self.candidates:
            return self.ladders
        if batch not in self._batch_ladders:
            self._batch_ladders[batch] = fit_trees(self.candidates, self.measured["latency"], self.measured["draft"],
                                                   self.measured["overhead"], self.buckets, batch=batch)
        return self._batch_ladders[batch]

    def batch_trees(self, batch: int) -> list:
        """Per context bucket, the tree predicted fastest for ``batch`` rows (JSON form; ``[]``: no speculation)."""
        return [ladder[0].tree for ladder in self.batch_ladders(batch)]

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
                "packed_verify_from_tokens": self.packed_from, "buckets": rows}

    def report(self) -> str:
        """The machine and, per context bucket, the fitted tree and its predicted speed (for logs)."""
        lines = [f"machine: {describe(self.fingerprint)}; "
                 + ("fit read from the cache" if self.cache_hit else f"probed in {self.probe_seconds:.1f} s")
                 + (f"; packed GEMM for verify forwards of {self.packed_from}+ tokens" if self.packed_from else "")]
        for row in self.summary()["buckets"]:
            lines.append(f"  context {row['context']:>9s}: tree {json.dumps(row['tree'])} -> predicted "
                         f"{row['predicted_tokens_per_second']:.1f} tok/s (plain decoding "
                         f"{row['predicted_plain_tokens_per_second']:.1f})")
        return "\n".join(lines)
