"""Calibration, the library half of ``medusa-lite calibrate``: measured head accuracy (:mod:`.accuracy`), trees
replayed or run on the target's own continuations (:mod:`.replay`), the heads' shipped acceptance table
(:mod:`.table`, what the hardware fit prices on every machine) and the stored no-fit tree (:mod:`.trees`)."""

from .accuracy import accuracies_from_counts, drafter_inputs, measure_head_accuracy, topk_hits
from .replay import (DEFAULT_LATENCY_TOKENS, BucketCounts, continuations, measure_forward_latency, measure_sampling,
                     replay_acceptance)
from .table import acceptance_candidates, acceptance_table
from .trees import (DEFAULT_SIZES, TreeCandidate, candidates_to_dicts, choose_tree, greedy_candidates,
                    sampling_candidates, score_trees, write_tree)

__all__ = ["BucketCounts", "DEFAULT_LATENCY_TOKENS", "DEFAULT_SIZES", "TreeCandidate", "accuracies_from_counts",
           "acceptance_candidates", "acceptance_table", "candidates_to_dicts", "choose_tree", "continuations",
           "drafter_inputs", "greedy_candidates", "measure_forward_latency", "measure_head_accuracy",
           "measure_sampling", "replay_acceptance", "sampling_candidates", "score_trees", "topk_hits", "write_tree"]
