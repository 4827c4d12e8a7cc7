"""Decoding: target forwards that return their timing (:mod:`.forward`), plans (:mod:`.plans`), one row
(:mod:`.sequence`) and the loop over a batch of rows (:mod:`.batch`). Knows about fitting only through the plan
it is given and the step report it returns (see :mod:`.plans`)."""

from .batch import SpeculativeBatch, run_batch, speculative_generate
from .forward import prefill, verify_forward, verify_rows
from .plans import BatchPlanner, GrownTree, Plan, PromptLookup, StaticTree, first_nodes
from .sequence import GenerationStats, Sequence, Stopper

__all__ = ["BatchPlanner", "GenerationStats", "GrownTree", "Plan", "PromptLookup", "Sequence", "SpeculativeBatch",
           "StaticTree", "Stopper", "first_nodes", "prefill", "run_batch", "speculative_generate", "verify_forward",
           "verify_rows"]
