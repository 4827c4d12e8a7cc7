"""medusa-lite calibrate: fit the candidate tree to a set of heads and to this hardware (DESIGN 3.2).

    medusa-lite calibrate --heads DIR                  # measure, choose, write DIR/tree.json + medusa_config.json
    medusa-lite calibrate --heads DIR --dry-run        # measure and report only
    medusa-lite calibrate --heads DIR --temperature 1  # the tree for sampling (stored next to the greedy one)

Stages: (1) the target's own greedy continuations of held-out prompts (by default the *last*
``--per-task`` Spec-Bench questions of each task, so a ``bench --limit N`` run with small N never sees
them), (2) per-head top-k accuracy against the target, teacher-forced, (3) the target's forward
latency vs number of tree tokens with a ``--cache-len`` cache, plus the measured per-step overhead
outside the forward, (4) candidate trees: the best static tree of every size by the accuracy
formula, and for Hydra heads dynamic trees of the same sizes; each is replayed on the continuations
(drafted as in decoding, walked against the target's tokens, drafting timed) and the one with the
best measured tokens per step / (forward latency + overhead) wins. The heads directory then decodes with
that tree by default; ``calibration.json`` there records every measurement.

With ``--temperature T`` the tree for sampling is chosen instead: sampled drafts are accepted with
probability min(1, p/q), so there is no fixed continuation to replay; the formula's best static trees
of ``--sample-sizes`` nodes, each with the prompt-lookup branches of ``--sample-lookup``, the current
sampling tree and no tree at all (the root alone: plain decoding, when nothing pays) are each run
(sampled generation after the held-out prompts, same seeds, trees alternated per prompt) and the
fastest measured decoding wins. It is stored as the dtype's sampling tree (``dtype_trees["<dtype>:sample"]``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from medusa_lite import MedusaConfig
from medusa_lite._hf import dtype_name
from medusa_lite.calibration import (DEFAULT_LATENCY_TOKENS, DEFAULT_SIZES, choose_tree, drafter_inputs,
                                     measure_forward_latency, measure_head_accuracy, measure_sampling,
                                     replay_acceptance)
from medusa_lite.config import TREE_NAME, sample_key
from medusa_lite.fit import interpolate_latency, monotone_latency
from medusa_lite.paths import PRETRAINED_DIR
from medusa_lite.settings import Ints, SettingsParser, option
from medusa_lite.specbench import DEFAULT_QUESTIONS, chat_prompt, load_questions
from medusa_lite.targets import load_model
from medusa_lite.tree import DynamicTree, WithLookup, grow_tree, parse_tree, tree_json, tree_nodes

REPORT_NAME = "calibration.json"


@dataclass
class CalibrateSettings:
    """``medusa-lite calibrate`` settings: these defaults < ``--config FILE`` < flags."""

    heads: str = option(str(PRETRAINED_DIR), "heads directory (default: the bundled heads)")
    target: str | None = option(None, "target: HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    dtype: Literal["fp32", "bf16"] = option("fp32", "dtype to measure latency in")
    questions: str = option(str(DEFAULT_QUESTIONS), "Spec-Bench question.jsonl (prompts)")
    per_task: int = option(2, "held-out prompts per Spec-Bench task (the last ones)")
    max_new_tokens: int = option(96, "length of the target's continuations")
    topk: int = option(10, "ranks measured per head")
    sizes: Ints = option(Ints(DEFAULT_SIZES), "tree sizes (nodes, root excluded)")
    latency_tokens: Ints = option(Ints(DEFAULT_LATENCY_TOKENS), "numbers of tree tokens (root included) whose "
                                                                "forward latency is measured")
    cache_len: int = option(256, "cache length during the latency measurement")
    repeats: int = option(5, "timed repeats per latency point")
    threads: int | None = option(None, "torch.set_num_threads (default: torch's choice)")
    seed: int = option(0, "seed")
    out: str | None = option(None, f"report JSON (default: HEADS/{REPORT_NAME})")
    dry_run: bool = option(False, "report only; leave the heads directory unchanged")
    continuations: str | None = option(None, "JSON cache of the target's continuations: reused when it matches, "
                                             "else written")
    replay: bool = option(True, "replay trees on the continuations; --no-replay: score trees by the independence "
                                "formula only (faster; no dynamic trees)")
    stride: int = option(2, "replay every N-th position of the continuations")
    lookup: Ints = option(Ints((4, 8, 12, 16)), "prompt-lookup branch lengths tried with the best trees")
    temperature: float = option(0.0, "0: the greedy tree (default); > 0: the tree for sampling at this temperature")
    sample_sizes: Ints = option(Ints((4, 8, 12)), "tree sizes run when --temperature > 0")
    sample_lookup: Ints = option(Ints((0, 4)), "prompt-lookup lengths (0: none) run then")
    acceptance: bool = option(False, "write the heads' hardware-independent acceptance table (acceptance.json: "
                                     "every candidate tree's tokens per step by context length, greedy replayed "
                                     "and sampled), from which generate fits the tree to whatever machine it runs "
                                     "on; no latency is measured")
    sample_temperature: float = option(1.0, "temperature of the table's sampled runs")
    sample_prompts: int | None = option(None, "run the table's sampled candidates after this many of the prompts "
                                              "(default: all)")
    save_tree: str | None = option(None, "also write the chosen tree to this JSON file (for bench --tree)")

    def __post_init__(self) -> None:
        tokens = set(self.latency_tokens) | {1, max(self.sizes) + 1}  # 1: plain decoding's forward, the baseline
        self.latency_tokens = Ints(sorted(tokens))


def parse_args(argv: list[str] | None = None) -> CalibrateSettings:
    parser = SettingsParser(CalibrateSettings, prog="medusa-lite calibrate", description=__doc__, kind="calibrate")
    return parser.parse(argv)[0]


def main(argv: list[str] | None = None) -> dict:
    # parse
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    heads_dir = Path(args.heads)

    # build
    model, tokenizer = load_model(args.target, heads_dir, dtype=args.dtype)
    target = model.base_model
    model.fit_enabled = False  # calibration measures trees itself
    questions = load_questions(args.questions, limit=args.per_task, from_end=True)

    # (1) the target's own greedy continuations (medusa_lite greedy == target greedy), with the step overhead
    sequences, overhead_per_step = continuations(model, tokenizer, questions, args)
    print(f"continuations: {len(sequences)} prompts, {sum(s.numel() - p for s, p in sequences)} tokens; "
          f"overhead outside target forwards {overhead_per_step * 1e3:.1f} ms/step")

    # (2) per-head accuracy, (3) latency vs tree tokens
    current = model.tree_for(sample=args.temperature > 0)
    accuracy = measure_head_accuracy(model, sequences, topk=args.topk)
    acc = accuracy["accuracies"]
    for k, row in enumerate(acc):
        print(f"head {k}: top-1 {row[0]:.3f}  top-{len(row)} {sum(row):.3f}")
    if args.acceptance:
        table = acceptance_table(model, sequences, acc, questions, args)
        if not args.dry_run:
            print(f"wrote {table.save(heads_dir)}")
        return table.to_dict()
    latency = measure_forward_latency(target, args.latency_tokens, cache_len=args.cache_len, repeats=args.repeats,
                                      seed=args.seed)
    table = monotone_latency({n: v["median"] for n, v in latency.items()})
    print("forward latency (ms) by tree tokens: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in table.items()))
    plain = 1.0 / table[min(table)]  # plain decoding: one token per single-token forward, no drafting

    # (4) choose: greedy, the formula's best trees replayed on the continuations; sampling, trees run
    if args.temperature > 0:
        rows = sampling_candidates(model, sequences, acc, current, args)
    else:
        rows = greedy_candidates(model, sequences, acc, table, overhead_per_step, current, args)
    best = max(rows, key=lambda r: (round(r["tokens_per_second"], 9), -r["size"]))
    for r in rows:
        mark = " <- best" if r is best else ""
        formula_note = f" (formula {r['expected_length']:.2f})" if "expected_length" in r else ""
        print(f"{r['kind']:7s} {r['size']:3d} nodes: {r['tokens_per_step']:.2f} tokens/step{formula_note}, "
              f"{r['step_ms']:.1f} ms/step, {r['tokens_per_second']:.1f} tokens/s{mark}")

    # save
    sampling = args.temperature > 0
    report = {
        "heads": str(heads_dir), "target": args.target or "SmolLM2-135M-Instruct", "dtype": args.dtype,
        "decoding": f"sampling T={args.temperature}" if sampling else "greedy",
        "threads": torch.get_num_threads(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"questions": str(args.questions), "question_ids": [q.question_id for q in questions],
                 "max_new_tokens": args.max_new_tokens, "continuations_cache": args.continuations},
        "accuracy": accuracy, "overhead_per_step": overhead_per_step, "cache_len": args.cache_len,
        "latency": {str(n): v for n, v in latency.items()},
        "latency_used": {str(n): v for n, v in table.items()},  # medians, made non-decreasing in n
        "plain_tokens_per_second_estimate": plain,
        "replay": {"enabled": args.replay, "stride": args.stride},
        "candidates": rows,
        "previous_tree": {"choices": tree_json(current)},
        "best": {"kind": best["kind"], "size": best["size"], "tokens_per_step": best["tokens_per_step"],
                 "estimated_tokens_per_second": best["tokens_per_second"], "choices": best["tree"]},
        "written": not args.dry_run,
    }
    if not args.dry_run:
        write_tree(heads_dir, best["tree"], report, sampling)
    if args.save_tree:
        Path(args.save_tree).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_tree).write_text(json.dumps({"choices": best["tree"]}) + "\n")
        print(f"wrote {args.save_tree}")
    name = REPORT_NAME if args.dtype == "fp32" else f"calibration-{args.dtype}.json"
    out = Path(args.out) if args.out else heads_dir / (name.replace(".json", "-sampling.json") if sampling else name)
    if args.out or not args.dry_run:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    print(f"best tree: {best['kind']}, {best['size']} nodes, {best['tokens_per_step']:.2f} tokens/step, "
          f"~{best['tokens_per_second']:.1f} tokens/s (plain decoding ~{plain:.1f} tokens/s)"
          f"{' (dry run: not written)' if args.dry_run else ''}")
    if best["tokens_per_second"] < plain:
        print("WARNING: the best tree's estimate is below plain decoding's single-token forward rate on this "
              "machine: better heads, or a dtype whose forward cost grows less with tokens (bf16), may be needed")
    return report


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


def acceptance_table(model, sequences, acc, questions, args):
    """Replay every greedy candidate on the continuations and run every sampling candidate after the prompts;
    the tokens per step (and tree tokens) per context bucket form the heads' :class:`AcceptanceTable`."""
    from medusa_lite.fit import BUCKETS, AcceptanceTable, Candidate

    greedy, sample = acceptance_candidates(model, acc)
    features = [drafter_inputs(model, ids) for ids, _ in sequences]
    rows = []
    for tree in tqdm(greedy, desc="replaying greedy candidates"):
        r = replay_acceptance(model, sequences, parse_tree(tree, model.config.num_heads), args.stride, features)
        rows.append(Candidate(tree=tree, **r["by_bucket"]))
    sampled, prompts = [], []
    if args.sample_temperature > 0:
        prompts = [ids[:start] for ids, start in sequences]
        if args.sample_prompts:  # spread over the tasks
            prompts = prompts[::max(1, len(prompts) // args.sample_prompts)][:args.sample_prompts]
        trees = [parse_tree(t, model.config.num_heads) for t in sample]
        measured = measure_sampling(model, prompts, trees, args.max_new_tokens, args.sample_temperature, args.seed)
        sampled = [Candidate(tree=t, **m["by_bucket"]) for t, m in zip(sample, measured)]
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "target": args.target or "SmolLM2-135M-Instruct",
            "dtype": args.dtype, "prompts": "Spec-Bench, the last %d questions of each task" % args.per_task,
            "question_ids": [q.question_id for q in questions], "max_new_tokens": args.max_new_tokens,
            "continuation_tokens": sum(s.numel() - p for s, p in sequences), "replay_stride": args.stride,
            "sampled_prompts": len(prompts),
            "command": "medusa-lite calibrate --acceptance " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])}
    for c in rows[:3] + sampled[:2]:
        print(f"{json.dumps(c.tree)}: tokens/step by bucket {[round(t, 2) for t in c.tokens_per_step]}")
    return AcceptanceTable(buckets=list(BUCKETS), greedy=rows, sample=sampled,
                           sample_temperature=args.sample_temperature or None, data=data)


def sampling_candidates(model, sequences, acc, current, args) -> list[dict]:
    """Trees for sampling, each run on the held-out prompts (:func:`medusa_lite.calibration.measure_sampling`)."""
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
    target = model.base_model
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


def continuations(model, tokenizer, questions, args) -> tuple[list[tuple[torch.Tensor, int]], float]:
    """[(prompt + the target's greedy continuation [L], prompt length)] and the seconds per decoding step
    spent outside target forwards. With ``--continuations FILE`` the sequences (which depend on the target,
    not on the heads) are read from FILE when it matches, else generated and written there; the overhead
    is then measured on one short generation."""
    cache = Path(args.continuations) if args.continuations else None
    key = {"question_ids": [q.question_id for q in questions], "max_new_tokens": args.max_new_tokens,
           "dtype": args.dtype, "target": args.target}
    sequences, overhead, steps = [], 0.0, 0
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            sequences = [(torch.tensor(ids), start) for ids, start in saved["sequences"]]
            model.generate(sequences[0][0][None, :sequences[0][1]], max_new_tokens=32, do_sample=False)
            stats = model.last_stats
            return sequences, (stats.wall_time - stats.target_time) / max(stats.verify_steps, 1)
        print(f"{cache} was made for other settings: generating the continuations again")
    for q in questions:
        ids = chat_prompt(tokenizer, q.prompt)
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        stats = model.last_stats
        overhead += stats.wall_time - stats.target_time
        steps += stats.verify_steps
        sequences.append((out[0], ids.shape[1]))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "sequences": [(s.tolist(), p) for s, p in sequences]}) + "\n")
    return sequences, overhead / max(steps, 1)


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


if __name__ == "__main__":
    main()
