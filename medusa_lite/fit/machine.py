"""One model's hardware fits: per decoding mode, dtype and device, the fit, its guards (one per context bucket, one
set for batched steps) and the verify kernels the probe found faster. What :class:`medusa_lite.MedusaModel`
consults to decode with a fitted tree."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable

from transformers import GenerationConfig

from .._hf import output_weight
from ..decode import BatchGuards, FittedPlan, Plan, SpeedGuard, make_plan
from ..kernels import Kernels, drafting_linears
from ..sampling import DraftSampler, build_warpers
from ..tree import parse_tree
from .pricing import HardwareFit, fit_trees
from .probe import DEFAULT_BUDGET_S
from .store import load_or_probe


@dataclass
class FitState:
    """The fit of one (sampling, dtype, device) and what decodes with it."""

    fit: HardwareFit
    guards: list[SpeedGuard]      # per context bucket, kept across generate calls
    batch: BatchGuards            # the tree of steps that verify several rows together
    kernels: Kernels | None = None  # what it decodes with (None: Kernels.defaults, the unfitted kernels)


class FitSession:
    """The hardware fits of ``model`` (a :class:`medusa_lite.MedusaModel`: its ``acceptance`` table, ``dtype``,
    ``device``, ``config`` and ``plan``), measured on first use per decoding mode. ``enabled``: False as with
    ``MEDUSA_LITE_FIT=0`` (decode with the heads' stored tree unless a call asks for the fit)."""

    def __init__(self, model):
        self.model = model
        self.enabled = os.environ.get("MEDUSA_LITE_FIT", "1").lower() not in ("0", "off", "false", "no")
        self._states: dict[tuple, FitState] = {}

    def key(self, sample: bool) -> tuple:
        """Fits are kept per (sampling, dtype, device)."""
        weight = output_weight(self.model.base_model)  # (the model's own properties: no call back into the facade)
        return sample, weight.dtype, weight.device

    def state(self, sample: bool) -> FitState | None:
        """The fit in use for ``sample`` (None: not fitted yet, or impossible)."""
        return self._states.get(self.key(sample))

    def clear(self) -> None:
        self._states.clear()

    def fit(self, sample: bool = False, *, force: bool = False, progress: bool = True,
            budget_s: float | None = None) -> HardwareFit | None:
        """See :meth:`medusa_lite.MedusaModel.fit_hardware`."""
        current = self.state(sample)
        if current is not None and not force:
            return current.fit
        model = self.model
        if model.acceptance is None:
            return None
        candidates = [c for c in model.acceptance.candidates(sample) if c.tree == [] or self._can_draft(c.tree)]
        if not candidates:
            warnings.warn("the heads' acceptance table has no tree these heads can draft: no hardware fit")
            return None
        sampler = DraftSampler(build_warpers(GenerationConfig(do_sample=True, top_k=0)), None) if sample else None
        # drafting is timed (and decodes) through the kernel, packed from the drafter's weights as they are now
        kernels = Kernels.defaults(model.base_model, draft_linears=drafting_linears(model.drafter))
        fingerprint, measured, hit, linears = load_or_probe(
            model, [c.tree for c in candidates if c.tree != []], force=force, progress=progress,
            budget_s=budget_s or DEFAULT_BUDGET_S, max_tokens_per_step=max(max(c.tokens_per_step) for c in candidates),
            sampler=sampler, kernels=kernels)
        buckets = tuple(model.acceptance.buckets)
        ladders = fit_trees(candidates, measured["latency"], measured["draft"], measured["overhead"], buckets)
        if linears is not None:
            linears.prepare()  # pack the weights now: no decoding step (nor the guard's timing) pays for it
        fit = HardwareFit(fingerprint, ladders, buckets, hit, measured["seconds"], measured["packed_from"],
                          measured["packed_to"], measured, candidates)
        self.use(fit, sample, kernels=replace(kernels, linears=linears))
        return fit

    def _can_draft(self, tree) -> bool:
        """Whether the model's heads can draft ``tree`` (JSON form): deep enough, Hydra heads for a dynamic tree."""
        try:
            make_plan(self.model.drafter, parse_tree(tree, self.model.config.num_heads), "cpu")
        except ValueError:
            return False
        return True

    def use(self, fit: HardwareFit, sample: bool = False, *, guard=SpeedGuard, kernels=None) -> None:
        """See :meth:`medusa_lite.MedusaModel.use_fit`."""
        self._states[self.key(sample)] = FitState(fit, [guard(ladder) for ladder in fit.ladders],
                                                  batch_guards(fit, guard), kernels)

    def _active(self, sample: bool, fit: bool | None) -> FitState | None:
        if fit is False or (fit is None and not self.enabled):
            return None
        if self.fit(sample) is None:
            return None
        return self.state(sample)

    def plan(self, sample: bool, make: Callable[[object], Plan], fit: bool | None) -> FittedPlan | None:
        """The plan over the fitted ladders (guards kept across calls; ``make(tree)``: the plan of one tree), or None
        when fitting is off (``fit=False``, or ``fit=None`` with ``enabled`` off) or impossible."""
        state = self._active(sample, fit)
        return None if state is None else FittedPlan(make, state.guards, state.fit.buckets)

    def batch_guards(self, sample: bool = False, fit: bool | None = None) -> BatchGuards | None:
        """The guards choosing the tree of batched steps, kept across calls per decoding mode, or None when fitting
        is off or impossible."""
        state = self._active(sample, fit)
        return None if state is None else state.batch

    def kernels(self, sample: bool) -> Kernels | None:
        state = self.state(sample)
        return None if state is None else state.kernels


def batch_guards(fit: HardwareFit, guard=SpeedGuard) -> BatchGuards:
    """Guards for batched steps over ``fit``'s ladders, priced ahead for every batch size decoding may meet."""
    return BatchGuards(fit.buckets, fit.priced_batches(), guard)
