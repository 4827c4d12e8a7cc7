"""Decoding: target forwards that return their timing (:mod:`.forward`), plans (:mod:`.plans`), one row
(:mod:`.sequence`), the loop over a batch of rows (:mod:`.batch`) and the guards that adapt the tree to realized
speed (:mod:`.adaptive`). Knows about fitting only through the ladders it is given (data the fit priced) and the
step report it returns (see :mod:`.plans`); it never calls the fit."""

from .adaptive import BUCKETS, BatchGuards, CyclingGuard, FittedPlan, Rung, SpeedGuard, bucket_of
from .batch import SpeculativeBatch, prefill_chunks, run_batch, same_prompt_groups, speculative_generate
from .forward import prefill, verify_forward, verify_rows
from .plans import (BatchPlanner, GrownTree, Plan, PlanCache, PromptLookup, StaticTree, draft_rows, first_nodes,
                    make_plan)
from .sequence import GenerationStats, Sequence
from .stopping import STOP_OPTIONS, Finish, StopRule, Stopper, eos_ids

__all__ = ["BUCKETS", "STOP_OPTIONS", "BatchGuards", "BatchPlanner", "CyclingGuard", "Finish", "FittedPlan", "GenerationStats",
           "GrownTree", "Plan", "PlanCache", "PromptLookup", "Rung", "Sequence", "SpeculativeBatch", "SpeedGuard",
           "StaticTree", "StopRule", "Stopper", "bucket_of", "draft_rows", "eos_ids", "first_nodes", "make_plan",
           "prefill", "prefill_chunks", "run_batch", "same_prompt_groups", "speculative_generate", "verify_forward",
           "verify_rows"]
