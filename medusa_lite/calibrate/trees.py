"""Choosing the stored tree offline (``medusa-lite calibrate`` without ``--acceptance``): the independence formula
(:func:`choose_tree`: per-head accuracies and measured latency, :func:`medusa_lite.tree.grow_tree` per size), the
candidates replayed or run (:func:`greedy_candidates`, :func:`sampling_candidates`), and the heads directory's
stored tree (:func:`write_tree`), which decoding uses when no hardware fit is made.

For each candidate size s, :func:`medusa_lite.tree.grow_tree` gives the best tree of s nodes; its
expected tokens per step is :func:`medusa_lite.tree.expected_length` and its expected speed is
``expected_length / (latency(s + 1) + overhead)``. :func:`choose_tree` picks the fastest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .._hf import dtype_name
from ..config import TREE_NAME, sample_key
from ..drafters import MedusaConfig
from ..fit import interpolate_latency
from ..tree import Choices, DynamicTree, WithLookup, expected_length, grow_tree, parse_tree, tree_json, tree_nodes
from .accuracy import drafter_inputs
from .replay import measure_sampling, replay_acceptance

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 63)


@dataclass
class TreeCandidate:
    """One tree size scored by :func:`choose_tree`."""

    size: int                  # nodes excluding the root
    expected_length: float     # expected tokens per step, bonus included
    latency: float             # seconds per step: forward of size + 1 tokens + overhead
    tokens_per_second: float   # expected_length / latency
    choices: Choices


def score_trees(accuracies: list[list[float]], latency: dict[int, float], sizes=DEFAULT_SIZES,
                overhead: float = 0.0) -> list[TreeCandidate]:
    """Grow the best tree of every size in ``sizes`` and estimate its speed. Sizes that cannot be grown
    (more nodes than the accuracies allow) collapse onto the largest possible tree and are dropped."""
    candidates: list[TreeCandidate] = []
    seen: set[int] = set()
    for size in sorted(set(int(s) for s in sizes)):
        if size < 1:
            raise ValueError(f"tree sizes must be >= 1, got {size}")
        choices = grow_tree(accuracies, size)
        if len(choices) in seen:
            continue
        seen.add(len(choices))
        step = interpolate_latency(latency, len(choices) + 1) + overhead
        length = expected_length(choices, accuracies)
        candidates.append(TreeCandidate(len(choices), length, step, length / step, choices))
    return candidates


def choose_tree(accuracies: list[list[float]], latency: dict[int, float], sizes=DEFAULT_SIZES,
                overhead: float = 0.0) -> tuple[TreeCandidate, list[TreeCandidate]]:
    """The tree maximising expected tokens per second (ties: the smaller tree), and all candidates."""
    candidates = score_trees(accuracies, latency, sizes, overhead)
    best = max(candidates, key=lambda c: (round(c.tokens_per_second, 9), -c.size))
    return best, candidates


def candidates_to_dicts(candidates: list[TreeCandidate]) -> list[dict]:
    return [asdict(c) for c in candidates]


def sampling_candidates(model, sequences, acc, current, args) -> list[dict]:
    """Trees for sampling, each run on the held-out prompts (:func:`medusa_lite.calibrate.replay.measure_sampling`)."""
    prompts = [ids[:start] for ids, start in sequences]
    trees = [("current", current), ("none", [])]  # none: the root alone, i.e. plain decoding in this loop
    for size in args.sample_sizes:
        static = grow_tree(acc, size)
        for tokens in args.sample_lookup:
            trees.append(("static+lookup" if tokens else "static", WithLookup(static, tokens) if tokens else static))
    measured = measure_sampling(model, prompts, [tree for _, tree in trees], args.max_new_tokens, args.temperature,
                                args.seed)
    return [{"kind": kind, "tree": tree_json(tree), "size": tree_nodes(tree), "tokens_per_step": r["tokens_per_step"],
             "step_ms": 1e3 * r["tokens_per_step"] / r["tokens_per_second"], "tokens_per_second": r["tokens_per_second"]}
            for (kind, tree), r in zip(trees, measured)]


def greedy_candidates(model, sequences, acc, table, overhead_per_step, current, args) -> list[dict]:
    """The formula's best static tree of every size (+ dynamic trees for Hydra heads), each replayed on the
    continuations (measured tokens/step and drafting time) unless ``--no-replay``, + prompt-lookup branches."""
    _, formula = choose_tree(acc, table, args.sizes, overhead=overhead_per_step)
    rows = [{"kind": "static", "tree": c.choices, "size": c.size, "expected_length": c.expected_length,
             "tokens_per_step": c.expected_length, "step_ms": c.latency * 1e3, "tokens_per_second": c.tokens_per_second}
            for c in formula]
    if args.replay:
        if model.drafter.dynamic_trees:
            rows += [{"kind": "dynamic", "tree": DynamicTree(n, model.config.num_heads, topk=k, expand=4).to_json(),
                      "size": n} for n in args.sizes if n >= 4 for k in (4, 8)]
        features = [drafter_inputs(model, ids) for ids, _ in sequences]
        base = replay_acceptance(model, sequences, current, args.stride, features)
        rest = max(overhead_per_step - base["draft_seconds"], 0.0)  # verification + bookkeeping per step

        def replayed(tree, nodes: float | None = None) -> tuple[dict, float]:
            """Measured speed of ``tree`` (forward of ``nodes`` tokens; default: as many as replayed)."""
            r = replay_acceptance(model, sequences, tree, args.stride, features)
            step = interpolate_latency(table, r["mean_nodes"] if nodes is None else nodes) + rest + r["draft_seconds"]
            return {"tokens_per_step": r["mean_tokens"], "draft_ms": r["draft_seconds"] * 1e3, "step_ms": step * 1e3,
                    "tokens_per_second": r["mean_tokens"] / step}, r["mean_nodes"]

        for row in rows:
            row.update(replayed(parse_tree(row["tree"]), row["size"] + 1)[0])
        for best_of_kind in _best_per_kind(rows):  # + a prompt-lookup branch (copies from the prompt / earlier output)
            for tokens in args.lookup:
                tree = WithLookup(parse_tree(best_of_kind["tree"]), tokens)
                measured, nodes = replayed(tree)  # the branch's length varies per step
                rows.append({"kind": best_of_kind["kind"] + "+lookup", "tree": tree.to_json(),
                             "size": round(nodes - 1), **measured})
    return rows


def _best_per_kind(rows: list[dict]) -> list[dict]:
    """The fastest replayed candidate of each kind (static, dynamic)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["kind"] not in best or r["tokens_per_second"] > best[r["kind"]]["tokens_per_second"]:
            best[r["kind"]] = r
    return list(best.values())


def write_tree(heads_dir: Path, choices: list[list[int]], report: dict, sampling: bool = False) -> None:
    """Make ``choices`` the heads' tree for the calibrated dtype (``dtype_trees``; fp32's greedy tree is also
    the default ``tree`` for dtypes never calibrated), in ``medusa_config.json`` and ``tree.json``.
    ``sampling``: the dtype's tree for sampling (key ``"<dtype>:sample"``)."""
    config = MedusaConfig.load(heads_dir)
    dtype = sample_key(report["dtype"]) if sampling else dtype_name(report["dtype"])
    config.dtype_trees[dtype] = choices
    if dtype == "float32" or config.tree is None:
        config.tree = choices
    config.save(heads_dir)
    summary = {k: report[k] for k in ("date", "dtype", "threads", "overhead_per_step")}
    summary["tokens_per_step"] = report["best"]["tokens_per_step"]
    summary["estimated_tokens_per_second"] = report["best"]["estimated_tokens_per_second"]
    tree_file = heads_dir / TREE_NAME
    old = json.loads(tree_file.read_text()) if tree_file.is_file() else {}
    calibration = old.get("calibration", {}) if isinstance(old.get("calibration"), dict) else {}
    calibration = {k: v for k, v in calibration.items() if k in config.dtype_trees} | {dtype: summary}
    tree_file.write_text(json.dumps({"choices": config.choices, "by_dtype": config.dtype_trees,
                                     "calibration": calibration}) + "\n")
    print(f"wrote the {dtype} tree to {tree_file} and {heads_dir / 'medusa_config.json'}")
