"""Fitting as a value: :func:`fit_machine` measures this machine (or reads its cached probe) for one decoding mode
and returns an immutable :class:`~.pricing.HardwareFit` (a ladder per context bucket and the one
:class:`~medusa_lite.kernels.Kernels` value decoding runs with); :func:`fit_state` makes the guards a model keeps
while it decodes with a fit. Nothing here holds a model: callers pass the target, the drafter, its config and the
heads' acceptance table."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple

from transformers import GenerationConfig

from .._hf import output_weight
from ..decode import BatchGuards, SpeedGuard, make_plan
from ..kernels import Kernels, drafting_linears
from ..sampling import DraftSampler, build_warpers
from ..tree import parse_tree
from .pricing import HardwareFit, fit_trees
from .probe import DEFAULT_BUDGET_S
from .store import load_or_probe
from .table import AcceptanceTable


class Subject(NamedTuple):
    """What the probe measures (:func:`~.probe.probe`, :func:`~.store.load_or_probe`): the target, its drafter and
    the drafter's config (:class:`medusa_lite.MedusaConfig`)."""

    base_model: object
    drafter: object
    config: object


@dataclass(frozen=True)
class FitState:
    """A fit in use for one decoding mode, and the guards decoding with it keeps across generate calls."""

    fit: HardwareFit
    guards: tuple[SpeedGuard, ...]  # one per context bucket
    batch: BatchGuards              # the tree of steps that verify several rows together


def fit_enabled_default() -> bool:
    """Whether ``generate`` decodes with the fit unless told otherwise: False as with ``MEDUSA_LITE_FIT=0``."""
    return os.environ.get("MEDUSA_LITE_FIT", "1").lower() not in ("0", "off", "false", "no")


def decoding_key(target, sample: bool) -> tuple:
    """Fits are kept per (sampling, dtype, device) of the target's output weights."""
    weight = output_weight(target)
    return sample, weight.dtype, weight.device


def fit_state(fit: HardwareFit, guard=SpeedGuard) -> FitState:
    """``fit`` with a fresh ``guard(ladder)`` per context bucket and guards for batched steps."""
    return FitState(fit, tuple(guard(ladder) for ladder in fit.ladders), batch_guards(fit, guard))


def can_draft(drafter, tree, num_heads: int) -> bool:
    """Whether ``drafter`` can draft ``tree`` (JSON form): deep enough, Hydra heads for a dynamic tree."""
    try:
        make_plan(drafter, parse_tree(tree, num_heads), "cpu")
    except ValueError:
        return False
    return True


def fit_machine(target, drafter, config, table: AcceptanceTable | None, sample: bool = False, *, force: bool = False,
                progress: bool = True, budget_s: float | None = None) -> HardwareFit | None:
    """The trees fitted to this machine for greedy decoding or sampling, and the kernels to decode them with.

    Combines ``table`` (the heads' acceptance table: shipped, hardware-independent) with this machine's measured
    verify latency and drafting cost (:func:`~.store.load_or_probe`: a bounded probe on first use per machine
    fingerprint, then a cache read; it logs which). None when there is no table or no tree the drafter can draft.
    ``force``: measure again even if a valid cached probe exists."""
    if table is None:
        return None
    candidates = [c for c in table.candidates(sample) if c.tree == [] or can_draft(drafter, c.tree, config.num_heads)]
    if not candidates:
        warnings.warn("the heads' acceptance table has no tree these heads can draft: no hardware fit")
        return None
    sampler = DraftSampler(build_warpers(GenerationConfig(do_sample=True, top_k=0)), None) if sample else None
    # drafting is timed (and decodes) through the kernel, packed from the drafter's weights as they are now
    kernels = Kernels.defaults(target, draft_linears=drafting_linears(drafter))
    fingerprint, measured, hit, linears = load_or_probe(
        Subject(target, drafter, config), [c.tree for c in candidates if c.tree != []], force=force,
        progress=progress, budget_s=budget_s or DEFAULT_BUDGET_S,
        max_tokens_per_step=max(max(c.tokens_per_step) for c in candidates), sampler=sampler, kernels=kernels)
    buckets = tuple(table.buckets)
    ladders = fit_trees(candidates, measured["latency"], measured["draft"], measured["overhead"], buckets)
    if linears is not None:
        linears.prepare()  # pack the weights now: no decoding step (nor the guard's timing) pays for it
    return HardwareFit(fingerprint, ladders, buckets, hit, measured["seconds"], measured["packed_from"],
                       measured["packed_to"], measured, candidates, kernels=replace(kernels, linears=linears))


def batch_guards(fit: HardwareFit, guard=SpeedGuard) -> BatchGuards:
    """Guards for batched steps over ``fit``'s ladders, priced ahead for every batch size decoding may meet."""
    return BatchGuards(fit.buckets, fit.priced_batches(), guard)
