"""Tree buffers and the acceptance walk as pure functions."""

from __future__ import annotations

import json

import pytest
import torch

from medusa_lite.tree import (attention_bias, build_buffers, chain, expected_length, grow_tree, load_tree,
                              sliding_attention_bias, tree_tokens, validate_choices)
from medusa_lite.verify import accept



def test_buffers_small_tree():
    b = build_buffers([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert b.num_nodes == 6 and b.depth == 2 and b.topk == 2
    assert b.depths.tolist() == [0, 1, 1, 2, 2, 2]
    # node [0,1] (index 4) sees root, [0] and itself only
    assert b.ancestor_mask[4].tolist() == [True, True, False, False, True, False]
    assert sorted(map(tuple, b.paths.tolist())) == [(0, 1, 3), (0, 1, 4), (0, 2, 5)]
    topk = torch.tensor([[10, 11], [20, 21]])
    assert tree_tokens(torch.tensor(9), topk, b).tolist() == [9, 10, 11, 20, 21, 20]


def test_attention_bias_sees_cache_and_ancestors():
    b = build_buffers(chain(3))
    bias = attention_bias(b, cache_len=4, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 8)
    allowed = bias[0, 0] == 0
    assert allowed[:, :4].all()
    assert torch.equal(allowed[:, 4:], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


@pytest.mark.parametrize("window", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("cache_len, kv_start", [(0, 0), (4, 0), (12, 0), (12, 8)])
def test_sliding_bias_on_a_chain_is_transformers_sliding_mask(window, cache_len, kv_start):
    """A chain is a plain sequence: its sliding mask must be transformers' own sliding-window causal mask
    over the same key positions (kv_start .. cache_len + N)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    b = build_buffers(chain(4))
    allowed = sliding_attention_bias(b, cache_len, torch.float32, window, kv_start)[0, 0] == 0
    fn = sliding_window_causal_mask_function(window)
    q = torch.arange(cache_len, cache_len + 5)[:, None]
    kv = torch.cat([torch.arange(kv_start, cache_len), torch.arange(cache_len, cache_len + 5)])[None, :]
    expected = fn(0, 0, q, kv)
    assert allowed.shape == expected.shape and torch.equal(allowed, expected)


def test_sliding_bias_tree_sees_own_window_and_ancestors():
    b = build_buffers([[0], [1], [0, 0], [0, 0, 0]])  # nodes: root, [0], [1], [0,0], [0,0,0]
    allowed = sliding_attention_bias(b, cache_len=10, dtype=torch.float32, window=3, kv_start=8)[0, 0] == 0
    # columns: cache positions 8, 9, then the 5 nodes
    assert allowed[0].tolist() == [True, True, True, False, False, False, False]  # root (pos 10): 8, 9, itself
    assert allowed[2].tolist() == [False, True, True, False, True, False, False]  # [1] (pos 11): 9, root, itself
    assert allowed[3].tolist() == [False, False, True, True, False, True, False]  # [0,0] (pos 12): root, [0]
    assert allowed[4].tolist() == [False, False, False, True, False, True, True]  # [0,0,0] (pos 13): root gone


def test_root_only_tree():
    b = build_buffers([])
    assert b.num_nodes == 1 and b.paths.tolist() == [[0]]
    nodes, bonus = accept(torch.tensor([5]), torch.tensor([7]), b.paths)
    assert nodes.tolist() == [0] and int(bonus) == 7


def test_accept_walk():
    b = build_buffers([[0], [1], [0, 0], [1, 0]])
    tokens = torch.tensor([9, 3, 4, 5, 6])
    # the target picks 4 at the root -> child [1]; then 6 at node [1] -> child [1,0]; then 8 there (bonus)
    choice = torch.tensor([4, 0, 6, 0, 8])
    nodes, bonus = accept(tokens, choice, b.paths)
    assert nodes.tolist() == [0, 2, 4] and int(bonus) == 8
    nodes, bonus = accept(tokens, torch.tensor([7, 0, 0, 0, 0]), b.paths)
    assert nodes.tolist() == [0] and int(bonus) == 7


@pytest.mark.parametrize("bad", [[[]], [[-1]], [[0], [0]], [[0, 0]], "x", [[0.5]]])
def test_invalid_trees(bad):
    with pytest.raises(ValueError):
        validate_choices(bad)


def test_depth_beyond_heads():
    with pytest.raises(ValueError, match="heads"):
        validate_choices(chain(5), num_heads=4)


def test_grow_tree_is_greedy_by_path_probability():
    acc = [[0.8, 0.1], [0.5, 0.2]]
    tree = grow_tree(acc, 3)
    assert tree == [[0], [0, 0], [0, 1]]  # 0.8, 0.8*0.5, 0.8*0.2 beat [1] = 0.1
    assert abs(expected_length(tree, acc) - (1 + 0.8 + 0.4 + 0.16)) < 1e-9


def test_shipped_trees_load():
    from medusa_lite.paths import CONFIGS_DIR

    files = sorted((CONFIGS_DIR / "trees").glob("*.json"))
    assert len(files) >= 4
    assert load_tree("medusa-16") == load_tree(CONFIGS_DIR / "trees" / "medusa-16.json")  # shipped trees by name
    sizes = {len(load_tree(f)) for f in files}
    assert {4, 16, 32, 64} <= sizes
    for f in files:
        assert "provenance" in json.loads(f.read_text())


def test_levels_give_each_depth_its_expanded_nodes_and_children():
    b = build_buffers([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 2]])
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,2]
    assert [lvl.expand.tolist() for lvl in b.levels] == [[0], [1, 2], [3]]
    assert [lvl.parent_row.tolist() for lvl in b.levels] == [[0], [0, 0], [0]]
    assert [lvl.children.tolist() for lvl in b.levels] == [[1, 2], [3, 4, 5], [6]]
    assert [lvl.child_row.tolist() for lvl in b.levels] == [[0, 0], [0, 0, 1], [0]]
    assert [lvl.child_rank.tolist() for lvl in b.levels] == [[0, 1], [0, 1, 0], [2]]
    assert [lvl.topk for lvl in b.levels] == [2, 2, 3]


def test_hydra_draft_tree_equals_per_node_recursion():
    """Level-by-level batched Hydra drafting == drafting every node from its own path, one at a time."""
    from conftest import random_heads, tiny_model

    from medusa_lite import MedusaConfig, MedusaModel
    from medusa_lite.config import DEFAULT_TREE

    target = tiny_model("llama")
    model = MedusaModel(target, MedusaConfig(num_heads=4, head_type="hydra", tree=DEFAULT_TREE))
    random_heads(model, std=0.3, seed=0)
    buffers = build_buffers(DEFAULT_TREE)
    hidden, ids = torch.randn(64), torch.tensor([5, 9, 17])
    tokens = model.drafter.draft_row(hidden, ids, buffers, 64).tokens
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def node_token(path):  # recursion along the path, batch of one
        state, token = hidden[None], ids[-1:]
        for d in range(len(path)):
            state = model.drafter.step(d, state, embed(token))
            token = lm_head(state).topk(path[d] + 1, dim=-1).indices[:, path[d]]
        return int(token)

    expected = [int(ids[-1])] + [node_token(p) for p in buffers.choices]
    assert tokens.tolist() == expected


def test_buffers_from_parents_equal_static_buffers():
    from medusa_lite.tree import buffers_from_parents

    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 2]]
    static = build_buffers(choices)
    # same nodes in the same order: root, [0], [1], [0,0], [0,1], [1,0], [0,0,2]
    dynamic = buffers_from_parents([-1, 0, 0, 1, 1, 2, 3])
    assert torch.equal(dynamic.depths, static.depths) and torch.equal(dynamic.ancestor_mask, static.ancestor_mask)
    assert sorted(map(tuple, dynamic.paths.tolist())) == sorted(map(tuple, static.paths.tolist()))
    assert dynamic.depth == 3 and dynamic.num_nodes == 7
    with pytest.raises(ValueError, match="precede"):
        buffers_from_parents([-1, 2, 0])


def _hydra(num_heads=3, seed=0):
    from conftest import random_heads, tiny_model

    from medusa_lite import MedusaConfig, MedusaModel

    return random_heads(MedusaModel(tiny_model("llama"), MedusaConfig(num_heads=num_heads, head_type="hydra")),
                        seed=seed)


def test_dynamic_tree_is_a_valid_tree_of_the_best_paths():
    from medusa_lite.tree import DynamicTree

    model = _hydra()
    hidden, ids = torch.randn(64), torch.tensor([5, 9, 17])
    # topk = expand = 1: the greedy chain, i.e. the static chain tree
    tokens, buffers, _ = model.drafter.draft_row(hidden, ids, DynamicTree(nodes=3, depth=3, topk=1, expand=1), 8)
    assert tokens.tolist() == model.drafter.draft_row(hidden, ids, build_buffers(chain(3)), 64).tokens.tolist()
    assert buffers.depths.tolist() == [0, 1, 2, 3]
    # expanding everything at depth 2 with all nodes kept: the full static tree, as a set of paths
    full = [[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(3)]
    tokens, buffers, _ = model.drafter.draft_row(hidden, ids, DynamicTree(nodes=12, depth=2, topk=3, expand=3), 8)
    static = model.drafter.draft_row(hidden, ids, build_buffers(full), 64).tokens
    assert sorted(tokens.tolist()) == sorted(static.tolist()) and buffers.num_nodes == 13
    # a budget: N nodes, parents kept, siblings distinct, depth capped by max_depth
    tokens, buffers, _ = model.drafter.draft_row(hidden, ids, DynamicTree(nodes=7, depth=3, topk=3, expand=2), 2)
    assert buffers.num_nodes == 8 and buffers.depth <= 2
    for path in buffers.paths.tolist():
        nodes = [n for n in path if n >= 0]
        assert all(buffers.depths[n] == d for d, n in enumerate(nodes))
    for parent in range(8):
        kids = [i for i in range(1, 8) if buffers.ancestor_mask[i].sum() == buffers.ancestor_mask[parent].sum() + 1
                and buffers.ancestor_mask[i, parent]]
        assert len({int(tokens[k]) for k in kids}) == len(kids)
    root_only, b, _ = model.drafter.draft_row(hidden, ids, DynamicTree(nodes=7, depth=3), 0)
    assert root_only.tolist() == [17] and b.num_nodes == 1


def test_dynamic_tree_stops_growing_below_min_prob():
    from medusa_lite.tree import DynamicTree

    model = _hydra()
    hidden, ids = torch.randn(64), torch.tensor([5, 9, 17])
    levels = []
    advance = model.drafter.advance_rows
    model.drafter.advance_rows = lambda ctxs, requests: levels.extend(r[0] for r in requests) or advance(ctxs, requests)
    full = model.drafter.draft_row(hidden, ids, DynamicTree(nodes=9, depth=3, topk=3, expand=3), 8)
    assert levels == [0, 1, 2]
    levels.clear()  # every path probability is below 0.999: one level (the root's children), then stop
    tokens, buffers, _ = model.drafter.draft_row(hidden, ids, DynamicTree(9, 3, 3, 3, min_prob=0.999), 8)
    assert levels == [0] and buffers.depth == 1 and tokens.tolist() == full.tokens[: 4].tolist()
    levels.clear()  # a floor below every score: exactly the tree without one
    tokens, buffers, _ = model.drafter.draft_row(hidden, ids, DynamicTree(9, 3, 3, 3, min_prob=1e-30), 8)
    assert levels == [0, 1, 2] and torch.equal(tokens, full.tokens) and buffers.parents == full.buffers.parents


def test_dynamic_tree_spec_parsing():
    from medusa_lite import MedusaConfig
    from medusa_lite.tree import DynamicTree, parse_tree

    assert parse_tree({"dynamic": {"nodes": 8, "depth": 3}}) == DynamicTree(8, 3)
    assert parse_tree({"tree": {"dynamic": {"nodes": 8, "depth": 3}}}) == DynamicTree(8, 3)  # no lookup branch
    assert parse_tree({"tree": [[0], [0, 0]]}) == parse_tree([[0], [0, 0]])
    with pytest.raises(ValueError, match="depth 5"):
        parse_tree({"dynamic": {"nodes": 8, "depth": 5}}, num_heads=4)
    with pytest.raises(ValueError, match="unknown keys"):
        parse_tree({"dynamic": {"nodes": 8, "depth": 3, "width": 2}})
    with pytest.raises(ValueError, match="positive"):
        parse_tree({"dynamic": {"nodes": 0, "depth": 3}})
    assert parse_tree({"dynamic": {"nodes": 8, "depth": 3, "min_prob": 0.05}}).min_prob == 0.05
    assert DynamicTree(8, 3, min_prob=0.05).to_json()["dynamic"]["min_prob"] == 0.05
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="min_prob"):
            DynamicTree(8, 3, min_prob=bad)
    with pytest.raises(ValueError, match="Hydra"):
        MedusaConfig(tree={"dynamic": {"nodes": 8, "depth": 3}})
    assert MedusaConfig(head_type="hydra", tree={"dynamic": {"nodes": 8, "depth": 3}}).choices == \
        {"dynamic": {"nodes": 8, "depth": 3, "topk": 4, "expand": 4}}


def test_prompt_lookup_continuation_and_merge():
    from medusa_lite.tree import lookup_continuation, merge_chain

    ids = torch.tensor([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2])
    assert lookup_continuation(ids, 3, 4).tolist() == [3, 4, 5, 1]  # latest earlier "1 2" -> "3 4 5 1"
    assert lookup_continuation(torch.tensor([5, 6, 7]), 3, 4).tolist() == []
    assert lookup_continuation(torch.tensor([5, 6, 5]), 3, 4).tolist() == [6, 5, 6, 5]  # 1-gram, around the period
    assert lookup_continuation(torch.tensor([3, 3, 3, 3]), 2, 5).tolist() == [3] * 5  # a run: its own continuation
    # tree: root(0) -> a(1)=3, b(2)=8; a -> c(3)=4. Chain 3 4 5 shares a and c, adds 5 under c.
    parents, tokens = merge_chain([-1, 0, 0, 1], [2, 3, 8, 4], [3, 4, 5])
    assert parents == [-1, 0, 0, 1, 3] and tokens == [2, 3, 8, 4, 5]
    parents, tokens = merge_chain([-1, 0], [2, 3], [6, 3])  # a new branch: siblings stay distinct
    assert parents == [-1, 0, 0, 2] and tokens == [2, 3, 6, 3]
    from medusa_lite.tree import WithLookup, parse_tree, tree_json

    spec = {"tree": [[0], [1]], "prompt_lookup": 6, "ngram": 2}
    assert parse_tree(spec) == WithLookup([[0], [1]], 6, 2) and tree_json(parse_tree(spec)) == spec
    with pytest.raises(ValueError, match="prompt_lookup"):
        parse_tree({"tree": [[0]], "prompt_lookup": 0})
