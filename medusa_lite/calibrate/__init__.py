"""Calibration, the library half of ``medusa-lite calibrate``: measured head accuracy (:mod:`.accuracy`), trees
replayed or run on the target's own continuations (:mod:`.replay`) and the heads' shipped acceptance table
(:mod:`.table`), which the hardware fit prices on every machine; the fit's own choice is stored as the no-fit tree."""

from .accuracy import accuracies_from_counts, drafter_inputs, measure_head_accuracy, topk_hits
from .replay import BucketCounts, continuations, measure_sampling, replay_acceptance, replay_trees
from .table import acceptance_candidates, acceptance_table

__all__ = ["BucketCounts", "accuracies_from_counts", "acceptance_candidates", "acceptance_table", "continuations",
           "drafter_inputs", "measure_head_accuracy", "measure_sampling", "replay_acceptance", "replay_trees",
           "topk_hits"]
