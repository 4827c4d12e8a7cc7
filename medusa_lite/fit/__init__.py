"""Fit speculation to the machine it runs on: the choice of tree, as pure functions.

Calibration has two halves:

* **hardware-independent, shipped with the heads** (``acceptance.json``, :class:`AcceptanceTable`): for
  every candidate tree, the tokens per step it yields (accepted + bonus) and the tree tokens it verifies
  per step, in each context-length bucket. Measured once, offline, by ``medusa-lite calibrate`` on the
  target's own continuations (greedy: replayed; sampling: run);
* **hardware-dependent, measured where the model runs** (:mod:`.probe`, kept by :mod:`.store`): the target's
  verify-forward latency against tree tokens and cache length, each candidate's drafting time, and the
  loop's per-step bookkeeping.

:func:`fit_trees` combines them. Per bucket, a candidate's predicted speed is
``tokens_per_step / (latency(nodes, context) + drafting + bookkeeping)``; the root alone (plain decoding
in the loop) is always a candidate, so the fitted tree is never predicted slower than no speculation.
The result per bucket is a *ladder*: the candidates predicted faster than plain decoding, fastest
first, ending with the root alone. The ladders are handed down to decoding as data (ladders for batched steps
priced ahead for every batch size), where :class:`~medusa_lite.decode.SpeedGuard` walks them when the realized
speed disagrees with the prediction: decoding never calls back into the fit.

Modules, each using only those before it: :mod:`.latency` (the latency model), :mod:`.table` (the shipped
acceptance table), :mod:`.pricing` (ladders, :class:`HardwareFit`), :mod:`.probe` (the measurements),
:mod:`.store` (their cache), :mod:`.machine` (:func:`fit_machine`: the fit of one decoding mode as an immutable
value, and the guards decoding keeps with it).
"""

from ..decode.adaptive import BatchGuards, CyclingGuard, FittedPlan, Rung, SpeedGuard  # what the ladders drive
from .latency import BUCKETS, bucket_contexts, bucket_of, interpolate_latency, latency_at, max_tokens, monotone_latency
from .pricing import MAX_RUNGS, PLAIN, PRICED_BATCHES, HardwareFit, fit_trees
from .machine import FitState, Subject, batch_guards, decoding_key, fit_enabled_default, fit_machine, fit_state
from .table import ACCEPTANCE_NAME, AcceptanceTable, Candidate

__all__ = ["ACCEPTANCE_NAME", "AcceptanceTable", "BUCKETS", "BatchGuards", "Candidate", "CyclingGuard", "FitState",
           "FittedPlan", "HardwareFit", "MAX_RUNGS", "PLAIN", "PRICED_BATCHES", "Rung", "SpeedGuard", "Subject",
           "batch_guards", "bucket_contexts", "bucket_of", "decoding_key", "fit_enabled_default", "fit_machine",
           "fit_state", "fit_trees", "interpolate_latency", "latency_at", "max_tokens", "monotone_latency"]
