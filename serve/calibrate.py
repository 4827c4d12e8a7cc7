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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from medusa_lite.calibrate import (DEFAULT_LATENCY_TOKENS, DEFAULT_SIZES, acceptance_table, continuations,
                                   greedy_candidates, measure_forward_latency, measure_head_accuracy,
                                   sampling_candidates, write_tree)
from medusa_lite.fit import monotone_latency
from medusa_lite.paths import PRETRAINED_DIR
from medusa_lite.settings import Ints, SettingsParser, option
from medusa_lite.specbench import DEFAULT_QUESTIONS, load_questions
from medusa_lite.targets import load_model
from medusa_lite.tree import tree_json

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
    model.fit_enabled = False  # calibration measures trees itself
    questions = load_questions(args.questions, limit=args.per_task, from_end=True)

    # (1) the target's own greedy continuations (medusa_lite greedy == target greedy), with the step overhead
    sequences, overhead_per_step = continuations(model, tokenizer, questions, args)
    print(f"continuations: {len(sequences)} prompts, {sum(s.numel() - p for s, p in sequences)} tokens; "
          f"overhead outside target forwards {overhead_per_step * 1e3:.1f} ms/step")

    # (2) per-head accuracy; with --acceptance, the heads' acceptance table and nothing else
    accuracy = measure_head_accuracy(model, sequences, topk=args.topk)
    for k, row in enumerate(accuracy["accuracies"]):
        print(f"head {k}: top-1 {row[0]:.3f}  top-{len(row)} {sum(row):.3f}")
    if args.acceptance:
        table = acceptance_table(model, sequences, accuracy["accuracies"], questions, args)
        if not args.dry_run:
            print(f"wrote {table.save(heads_dir)}")
        return table.to_dict()

    # (3) latency vs tree tokens, (4) the candidates measured, the best chosen
    report = choose(model, sequences, accuracy, overhead_per_step, args, heads_dir, questions)

    # save
    save(heads_dir, report, args)
    return report


def choose(model, sequences, accuracy: dict, overhead_per_step: float, args: CalibrateSettings, heads_dir: Path,
           questions: list) -> dict:
    """Measure the latency table and every candidate tree: the report, its best tree under ``"best"``."""
    current = model.tree_for(sample=args.temperature > 0)
    acc = accuracy["accuracies"]
    latency = measure_forward_latency(model.base_model, args.latency_tokens, cache_len=args.cache_len,
                                      repeats=args.repeats, seed=args.seed)
    table = monotone_latency({n: v["median"] for n, v in latency.items()})
    print("forward latency (ms) by tree tokens: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in table.items()))
    plain = 1.0 / table[min(table)]  # plain decoding: one token per single-token forward, no drafting
    if args.temperature > 0:  # greedy: the formula's best trees replayed on the continuations; sampling: trees run
        rows = sampling_candidates(model, sequences, acc, current, args)
    else:
        rows = greedy_candidates(model, sequences, acc, table, overhead_per_step, current, args)
    best = max(rows, key=lambda r: (round(r["tokens_per_second"], 9), -r["size"]))
    for r in rows:
        mark = " <- best" if r is best else ""
        formula_note = f" (formula {r['expected_length']:.2f})" if "expected_length" in r else ""
        print(f"{r['kind']:7s} {r['size']:3d} nodes: {r['tokens_per_step']:.2f} tokens/step{formula_note}, "
              f"{r['step_ms']:.1f} ms/step, {r['tokens_per_second']:.1f} tokens/s{mark}")
    return {
        "heads": str(heads_dir), "target": args.target or "SmolLM2-135M-Instruct", "dtype": args.dtype,
        "decoding": f"sampling T={args.temperature}" if args.temperature > 0 else "greedy",
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


def save(heads_dir: Path, report: dict, args: CalibrateSettings) -> None:
    """Write the chosen tree into the heads directory (unless ``--dry-run``), ``--save-tree`` and the report."""
    sampling, best = args.temperature > 0, report["best"]
    if not args.dry_run:
        write_tree(heads_dir, best["choices"], report, sampling)
    if args.save_tree:
        Path(args.save_tree).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_tree).write_text(json.dumps({"choices": best["choices"]}) + "\n")
        print(f"wrote {args.save_tree}")
    name = REPORT_NAME if args.dtype == "fp32" else f"calibration-{args.dtype}.json"
    out = Path(args.out) if args.out else heads_dir / (name.replace(".json", "-sampling.json") if sampling else name)
    if args.out or not args.dry_run:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    plain = report["plain_tokens_per_second_estimate"]
    print(f"best tree: {best['kind']}, {best['size']} nodes, {best['tokens_per_step']:.2f} tokens/step, "
          f"~{best['estimated_tokens_per_second']:.1f} tokens/s (plain decoding ~{plain:.1f} tokens/s)"
          f"{' (dry run: not written)' if args.dry_run else ''}")
    if best["estimated_tokens_per_second"] < plain:
        print("WARNING: the best tree's estimate is below plain decoding's single-token forward rate on this "
              "machine: better heads, or a dtype whose forward cost grows less with tokens (bf16), may be needed")


if __name__ == "__main__":
    main()
