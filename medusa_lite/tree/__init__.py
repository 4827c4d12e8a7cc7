"""Candidate trees: Medusa's ``medusa_choices`` format -> buffers built once per tree.

A tree is a list of paths of top-k ranks, e.g. ``[[0], [1], [0, 0], [0, 1]]``: node ``[0, 1]`` holds
head 0's top-1 token followed by head 1's top-2 token. Node 0 is the root: the token already chosen
from the target's distribution, not yet in the KV cache. A node at depth d (d >= 1) holds the
``path[-1]``-ranked token of head ``d - 1``.

Modules: :mod:`.spec` (forms, parsing, keys, shipped trees), :mod:`.buffers` (tensors of a tree, attention biases),
:mod:`.lookup` (prompt-lookup branches), :mod:`.design` (expected length, growth).
"""

from .buffers import (Level, TreeBuffers, attention_bias, buffers_from_parents, build_buffers, sliding_attention_bias,
                      tree_tokens, within_window)
from .design import expected_length, grow_tree
from .lookup import lookup_continuation, merge_chain
from .spec import (Choices, DynamicTree, TreeSpec, WithLookup, chain, has_lookup, load_tree, parse_tree, tree_json,
                   tree_key, tree_nodes, truncate, validate_choices)

__all__ = ["Choices", "DynamicTree", "Level", "TreeBuffers", "TreeSpec", "WithLookup", "attention_bias",
           "buffers_from_parents", "build_buffers", "chain", "expected_length", "grow_tree", "has_lookup", "load_tree",
           "lookup_continuation", "merge_chain", "parse_tree", "sliding_attention_bias", "tree_json", "tree_key",
           "tree_nodes", "tree_tokens", "truncate", "validate_choices", "within_window"]
