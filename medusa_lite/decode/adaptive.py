"""Decoding that adapts to the machine: the online guards that compare realized with predicted speed and move along a
context bucket's *ladder* of trees (:class:`SpeedGuard`; :class:`BatchGuards` for steps of several rows), and the
plan that drafts each step with the tree its guard names (:class:`FittedPlan`).

The ladders are data the hardware fit (:mod:`medusa_lite.fit`) prices and hands down: a list of :class:`Rung` per
context bucket. Nothing here calls back into the fit, so one ``generate`` call descends model -> fit (the ladders,
once) and model -> decode, never returning up a layer while decoding.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..drafters import Draft, DraftState
from ..tree import tree_key
from .plans import Plan

BUCKETS = (0, 256, 1024)            # context-length buckets: [0, 256), [256, 1024), [1024, ...)


def bucket_of(context: int, buckets=BUCKETS) -> int:
    """Index of the bucket holding a cache of ``context`` tokens."""
    index = 0
    for i, lo in enumerate(buckets):
        if context >= lo:
            index = i
    return index


@dataclass
class Rung:
    """One tree of a bucket's ladder and its prediction on this machine."""

    tree: list | dict
    tokens_per_step: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


class SpeedGuard:
    """Checks a bucket's ladder against realized speed while decoding and moves along it.

    Starts on the first rung (the fitted tree). After ``window`` steps on a rung, its realized tokens/s
    (tokens emitted / wall seconds of its last steps, up to ``memory`` of them: a rung that has held for a while is
    judged on more steps than one just tried, so a short run of misses, which a drafter accepting a token on a
    third of its steps has every few dozen steps, does not throw away a tree that pays) is compared with every
    rung below it: with a rung's own
    realized speed when it was measured recently, else with its prediction corrected by what the current
    rung showed, both in time (steps running slower than predicted: a busy machine) and in acceptance
    (fewer drafted tokens accepted than the table says: harder text than the calibration's). The guard
    moves to the fastest of them, down to the root alone (no speculation). After ``retry`` steps below the
    top it tries a rung above again, for ``window`` steps (the rungs above take turns: :meth:`next_try`), so a
    tree that stopped paying for a while is picked up again when it pays; a try that fails doubles the wait
    before the next one (up to ``max_retry``), one that holds resets it, so text where no tree pays costs little
    exploring.

    Exactness: :meth:`rung` depends only on steps already finished (their token counts and durations),
    never on the draws of the step it is asked for. A step's tree is therefore fixed before that step
    drafts, and every acceptance rule (greedy walk, rejection sampling) is exact whatever tree it gets.
    """

    def __init__(self, ladder: list[Rung], window: int = 8, retry: int = 64, max_retry: int = 1024,
                 memory: int | None = None):
        if not ladder:
            raise ValueError("a ladder needs at least one rung")
        self.ladder = ladder
        self.window, self.retry, self.max_retry = window, retry, max_retry
        memory = 4 * window if memory is None else memory
        if memory < window:
            raise ValueError(f"memory ({memory}) must be at least window ({window})")
        self.wait = retry                                      # steps below the top before the next try up
        self.trying = False                                    # on a rung reached by a try, window not done
        self.level = 0
        self.recent = [deque(maxlen=memory) for _ in ladder]  # (tokens, seconds) of the last steps per rung
        self.age = [math.inf for _ in ladder]                  # steps since a rung's figures were taken
        self.below_top = 0                                     # steps since the last move

    def rung(self) -> int:
        """The rung for the next step (decided by past steps only)."""
        return self.level

    def realized(self, level: int) -> float | None:
        """Tokens/s of the last steps on ``level`` (up to ``memory``), once it has ``window`` of them."""
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
                self.move(best)
                return
            if self.trying:  # the try held for a window
                self.wait, self.trying = self.retry, False
        if level > 0:
            self.below_top += 1
            if self.below_top >= self.wait:
                self.move(self.next_try(level))
                self.trying = True

    def next_try(self, level: int) -> int:
        """The rung above ``level`` to try next: the one whose figures are oldest (never taken first, nearest
        first among those), so the rungs above take turns; always the one just above would never reach a lookup
        rung past a drafter-alone rung that does not pay, however much the text starts to repeat itself."""
        return max(range(level), key=lambda r: (self.age[r], r))

    def estimate(self, level: int, measured: int) -> float:
        """Tokens/s expected of ``level``: realized if fresh, else its prediction corrected by the ``measured``
        rung's realized step time (time factor) and realized drafted tokens per step (acceptance factor)."""
        fresh = self.realized(level)
        if fresh is not None and self.age[level] <= self.wait + self.window:
            return fresh
        steps, seen = self.recent[measured], self.ladder[measured]
        rung = self.ladder[level]
        slowdown = (sum(s for _, s in steps) / len(steps)) / seen.step_seconds
        drafted = sum(t for t, _ in steps) / len(steps) - 1.0  # accepted drafted tokens per step
        acceptance = min(drafted / (seen.tokens_per_step - 1.0), 1.0) if seen.tokens_per_step > 1.0 else 1.0
        return (1.0 + max(acceptance, 0.0) * (rung.tokens_per_step - 1.0)) / (rung.step_seconds * slowdown)

    def move(self, level: int) -> None:
        """Go to rung ``level`` now, its recent figures forgotten."""
        self.level = level
        self.recent[level].clear()
        self.below_top = 0


class CyclingGuard(SpeedGuard):
    """A guard that moves one rung down after every step, wrapping around: every tree of the ladder in turn,
    whatever the timings. For tests of exactness across tree changes (a choice that depends on the past only)."""

    def record(self, tokens: int, seconds: float) -> None:
        self.level = (self.level + 1) % len(self.ladder)


class BatchGuards:
    """The tree of steps that verify B > 1 rows together: per (batch size, context bucket) the ladder the fit priced
    for that many rows (``ladders``: ``{B: ladders per bucket}``, priced ahead for the batch sizes the fit chose;
    a batch between two of them takes the smaller's), walked by its own guard (``guard(ladder)``, a
    :class:`SpeedGuard`) on the realized speed of those steps (per row: tokens emitted by all rows / B, step
    seconds / B).

    The batch size changes whenever a request joins or leaves, so what one guard learned is shared: the
    drafted tokens accepted per step on tree rungs, against what their ladders predicted (the last
    ``window`` such steps of any batch size). A guard created later starts on the rung that ratio predicts
    fastest instead of re-learning from the top (on chat text the shipped table's lookup branches are
    accepted far less than on the calibration's).

    Exactness as for one row: :meth:`tree` depends only on finished steps, so a step's tree is fixed before
    any row drafts it."""

    def __init__(self, buckets: tuple[int, ...], ladders: dict[int, list[list[Rung]]], guard=None, window: int = 32):
        self.buckets, self.ladders, self.guard = tuple(buckets), ladders, guard or SpeedGuard
        self._guards: dict[tuple[int, int], SpeedGuard] = {}
        self._last: SpeedGuard | None = None
        self._drafted: deque = deque(maxlen=window)  # (predicted, realized) drafted tokens per row, tree rungs

    def tree(self, batch: int, context: int):
        """The tree (JSON form) for the next step of ``batch`` rows whose longest cache holds ``context`` tokens."""
        key = (batch, bucket_of(context, self.buckets))
        if key not in self._guards:
            priced = max((b for b in self.ladders if b <= batch), default=min(self.ladders))
            guard = self._guards[key] = self.guard(self.ladders[priced][key[1]])
            if self._drafted:
                guard.move(self._best_start(guard.ladder))
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


class FittedPlan:
    """A :data:`Plan` that drafts each step with the tree its context bucket's :class:`SpeedGuard` names (a ladder
    fitted to this machine, :func:`medusa_lite.fit.fit_trees`); :meth:`record` (the loop's ``on_step``) tells the
    guard how the step went. ``make(tree)``: the plan of a tree (JSON form), e.g. a :class:`~.plans.PlanCache`.

    The tree of a step is chosen before the step drafts, from finished steps only, so the step's
    acceptance (greedy walk or rejection sampling) is exact whatever tree the guard picks.
    """

    def __init__(self, make: Callable[[object], Plan], guards: list, buckets: tuple[int, ...]):
        self.make, self.guards, self.buckets = make, guards, buckets
        self._bucket = 0
        self.steps_by_tree: dict[str, int] = {}
        self.realized = [[0, 0.0] for _ in guards]  # tokens, seconds per bucket

    def __call__(self, state: DraftState, max_depth: int) -> list[Draft]:
        self._bucket = bucket_of(state.ids[0].numel() - 1, self.buckets)  # the cache length (ids end in the root)
        guard = self.guards[self._bucket]
        tree = guard.ladder[guard.rung()].tree
        key = tree_key(tree)
        self.steps_by_tree[key] = self.steps_by_tree.get(key, 0) + 1
        return self.make(tree)(state, max_depth)

    def record(self, tokens: int, seconds: float) -> None:
        self.guards[self._bucket].record(tokens, seconds)
        self.realized[self._bucket][0] += tokens
        self.realized[self._bucket][1] += seconds

    def report(self) -> dict:
        """Steps per tree and realized tokens/s per bucket (speculative steps only, prefill excluded)."""
        return {"steps_by_tree": dict(self.steps_by_tree), "realized": [list(r) for r in self.realized],
                "realized_tokens_per_second": [t / s if s > 0 else None for t, s in self.realized]}
