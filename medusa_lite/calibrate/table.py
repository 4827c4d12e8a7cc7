"""The heads' acceptance table (``acceptance.json``, :class:`medusa_lite.fit.AcceptanceTable`): every candidate tree's
tokens per step by context bucket, greedy replayed on the target's continuations and sampled run after the prompts.
Hardware-independent; the library half of ``medusa-lite calibrate``."""

from __future__ import annotations

import json
import time

from ..fit import BUCKETS, AcceptanceTable, Candidate
from ..tree import DynamicTree, WithLookup, grow_tree, parse_tree, tree_json
from .accuracy import drafter_inputs
from .replay import measure_sampling, replay_trees

ACCEPTANCE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ACCEPTANCE_LOOKUP = (4, 8, 16)
SAMPLE_SIZES = (1, 2, 4, 8)


def acceptance_candidates(model, acc) -> tuple[list, list]:
    """(greedy, sampling) candidate trees of an acceptance table: for greedy, the formula's best static tree
    of every size, Hydra heads' dynamic trees, each also with prompt-lookup branches, and the lookup branch
    alone; for sampling, smaller static trees with and without a short lookup branch. The root alone is
    always a candidate (plain decoding) and needs no entry."""
    statics = []
    for size in ACCEPTANCE_SIZES:
        tree = grow_tree(acc, size)
        if tree not in statics:
            statics.append(tree)
    bases = list(statics)
    if model.drafter.dynamic_trees:
        bases += [DynamicTree(n, model.config.num_heads, topk=4, expand=4) for n in (4, 8, 16, 32)]
    greedy = [tree_json(t) for t in bases]
    greedy += [WithLookup(t, n).to_json() for t in bases for n in ACCEPTANCE_LOOKUP]
    greedy += [WithLookup([], n).to_json() for n in ACCEPTANCE_LOOKUP]
    sample = [grow_tree(acc, n) for n in SAMPLE_SIZES]
    sample = sample + [WithLookup(t, 4).to_json() for t in sample] + [WithLookup([], 4).to_json()]
    return greedy, sample


def acceptance_table(model, sequences, acc, questions, *, max_new_tokens: int, sample_temperature: float = 1.0,
                     sample_prompts: int | None = None, seed: int = 0, about: dict | None = None) -> AcceptanceTable:
    """Replay every greedy candidate on the continuations and run every sampling candidate after the prompts
    (``sample_prompts`` of them spread over the tasks, None: all; ``sample_temperature`` 0: greedy rows only); the
    tokens per step (and tree tokens) per context bucket form the heads' :class:`AcceptanceTable`. ``about``: what
    the table's ``data`` records of where it came from (target, dtype, prompts, command)."""
    greedy, sample = acceptance_candidates(model, acc)
    features = [drafter_inputs(model, ids) for ids, _ in sequences]
    replayed = replay_trees(model, sequences, [parse_tree(t, model.config.num_heads) for t in greedy], features,
                            progress=True)
    rows = [Candidate(tree=tree, **r["by_bucket"]) for tree, r in zip(greedy, replayed)]
    sampled, prompts = [], []
    if sample_temperature > 0:
        prompts = [ids[:start] for ids, start in sequences]
        if sample_prompts:  # spread over the tasks
            prompts = prompts[::max(1, len(prompts) // sample_prompts)][:sample_prompts]
        trees = [parse_tree(t, model.config.num_heads) for t in sample]
        measured = measure_sampling(model, prompts, trees, max_new_tokens, sample_temperature, seed, progress=True)
        sampled = [Candidate(tree=t, **m["by_bucket"]) for t, m in zip(sample, measured)]
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(about or {}),
            "question_ids": [q.question_id for q in questions], "max_new_tokens": max_new_tokens,
            "continuation_tokens": sum(s.numel() - p for s, p in sequences), "replay": "greedy decoding's steps",
            "sampled_prompts": len(prompts)}
    for c in rows[:3] + sampled[:2]:
        print(f"{json.dumps(c.tree)}: tokens/step by bucket {[round(t, 2) for t in c.tokens_per_step]}")
    return AcceptanceTable(buckets=list(BUCKETS), greedy=rows, sample=sampled,
                           sample_temperature=sample_temperature or None, data=data)
