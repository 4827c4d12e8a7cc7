"""medusa-lite calibrate: measure a set of heads' acceptance and fit their tree to this machine.

    medusa-lite calibrate --heads DIR                  # DIR/acceptance.json + the fitted no-fit tree, report
    medusa-lite calibrate --heads DIR --dry-run        # measure and report only
    medusa-lite calibrate --heads DIR --fallback-only  # keep DIR/acceptance.json; fit this machine, store its tree

One path chooses trees, the hardware fit (:mod:`medusa_lite.fit`):

1. the target's own greedy continuations of held-out prompts: by default the shipped calibration prompts
   (``medusa_lite/data/calibration``: the campaign's held-out ShareGPT prompts of seven kinds, which no drafter
   trains on, and never the benchmark's questions: a table measured on Spec-Bench text would tune the trees to
   the benchmark), the last ``--per-task`` of each kind;
2. per-head top-k accuracy against the target, teacher-forced;
3. the heads' **acceptance table** (``acceptance.json``, hardware-independent): every candidate tree (the accuracy
   formula's best static tree of each size, Hydra heads' dynamic trees, prompt-lookup branches) replayed on the
   continuations for greedy decoding and run with sampling after the prompts, tokens per step by context bucket;
4. the **fit** on this machine (the same probe ``generate`` runs on first use, cached per machine): latency by tree
   tokens and context, drafting time, bookkeeping, priced against the table. Its tree for the context bucket the
   table measured most becomes the heads' stored ``tree`` in ``medusa_config.json``: what decoding uses where no
   fit is made (``fit=False``, ``MEDUSA_LITE_FIT=0``). Every other machine fits its own tree from the table.

``calibration.json`` in the heads directory records the accuracies and the fit.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_lite import MedusaConfig
from medusa_lite.calibrate import acceptance_table, continuations, measure_head_accuracy
from medusa_lite.fit import AcceptanceTable
from medusa_lite.paths import PRETRAINED_DIR
from medusa_lite.settings import SettingsParser, TargetOptions, option
from medusa_lite.specbench import CALIBRATION_PROMPTS, load_questions
from medusa_lite.targets import load_model

REPORT_NAME = "calibration.json"


@dataclass
class CalibrateSettings(TargetOptions):
    """``medusa-lite calibrate`` settings: these defaults < ``--config FILE`` < flags."""

    heads: str = option(str(PRETRAINED_DIR), "heads directory (default: the bundled heads)")
    questions: str = option(str(CALIBRATION_PROMPTS), "prompts JSONL: rows {question_id, task, turns} or Spec-Bench's "
                                                      "question.jsonl (default: the shipped calibration prompts)")
    per_task: int = option(2, "prompts per task (the last ones)")
    max_new_tokens: int = option(96, "length of the target's continuations")
    topk: int = option(10, "ranks measured per head")
    threads: int | None = option(None, "torch.set_num_threads (default: torch's choice)")
    seed: int = option(0, "seed")
    out: str | None = option(None, f"report JSON (default: HEADS/{REPORT_NAME})")
    dry_run: bool = option(False, "report only; leave the heads directory unchanged")
    continuations: str | None = option(None, "JSON cache of the target's continuations: reused when it matches, "
                                             "else written")
    sample_temperature: float = option(1.0, "temperature of the table's sampled runs (0: greedy rows only)")
    sample_prompts: int | None = option(None, "run the table's sampled candidates after this many of the prompts "
                                              "(default: all)")
    fallback_only: bool = option(False, "keep the heads' acceptance table as it is: only fit this machine and store "
                                        "the fit's tree as the no-fit fallback")
    probe_budget: float | None = option(None, "seconds the fit's probe may take (default: the library's)")
    save_tree: str | None = option(None, "also write the fallback tree to this JSON file (for bench --tree)")


def parse_args(argv: list[str] | None = None) -> CalibrateSettings:
    parser = SettingsParser(CalibrateSettings, prog="medusa-lite calibrate", description=__doc__, kind="calibrate")
    return parser.parse(argv)[0]


def main(argv: list[str] | None = None) -> dict:
    # parse
    args = parse_args(argv).resolve()  # the table and the report name the dtype that ran
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    heads_dir = Path(args.heads)

    # build
    model, tokenizer = load_model(heads=heads_dir, **args.load_kwargs())
    model.fit_enabled = False  # the continuations are decoded with the stored tree; the fit comes last
    report = {"heads": str(heads_dir), "target": args.target or "SmolLM2-135M-Instruct", "dtype": args.dtype,
              "threads": torch.get_num_threads(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # (1-3) the acceptance table, measured (or the heads' own, with --fallback-only)
    if args.fallback_only:
        if model.acceptance is None:
            raise SystemExit(f"{heads_dir} has no acceptance table: run calibrate without --fallback-only")
    else:
        model.acceptance = measure_table(model, tokenizer, args, report)
        if not args.dry_run:
            print(f"wrote {model.acceptance.save(heads_dir)}")

    # (4) the fit on this machine; its tree becomes the no-fit fallback
    fit = model.fit_hardware(force=True, budget_s=args.probe_budget)
    if fit is None:
        raise SystemExit(f"no tree in {heads_dir}'s acceptance table can be drafted by these heads: nothing to fit")
    print(fit.report())
    report["fit"] = fit.summary()
    report["fallback_tree"] = fit.fallback_tree()
    save(heads_dir, report, args)
    return report


def measure_table(model, tokenizer, args: CalibrateSettings, report: dict) -> AcceptanceTable:
    """The target's continuations, the heads' accuracy and their acceptance table (added to ``report``)."""
    questions = load_questions(args.questions, limit=args.per_task, from_end=True)
    sequences, overhead_per_step = continuations(model, tokenizer, questions, args.max_new_tokens, args.continuations,
                                                 {"dtype": args.dtype, "target": args.target})
    print(f"continuations: {len(sequences)} prompts, {sum(s.numel() - p for s, p in sequences)} tokens; "
          f"overhead outside target forwards {overhead_per_step * 1e3:.1f} ms/step")
    accuracy = measure_head_accuracy(model, sequences, topk=args.topk)
    for k, row in enumerate(accuracy["accuracies"]):
        print(f"head {k}: top-1 {row[0]:.3f}  top-{len(row)} {sum(row):.3f}")
    report["data"] = {"questions": str(args.questions), "question_ids": [q.question_id for q in questions],
                      "max_new_tokens": args.max_new_tokens, "continuations_cache": args.continuations}
    report["accuracy"] = accuracy
    about = {"target": args.target or "SmolLM2-135M-Instruct", "dtype": args.dtype,
             "prompts": f"{_short(args.questions)}, the last {args.per_task} of each task",
             "command": "medusa-lite calibrate " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])}
    return acceptance_table(model, sequences, accuracy["accuracies"], questions, max_new_tokens=args.max_new_tokens,
                            sample_temperature=args.sample_temperature, sample_prompts=args.sample_prompts,
                            seed=args.seed, about=about)


def _short(path) -> str:
    """``folder/file`` of a prompts file: names the set without this machine's paths."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}"


def save(heads_dir: Path, report: dict, args: CalibrateSettings) -> None:
    """Store the fallback tree in the heads' config (unless ``--dry-run``), ``--save-tree`` and the report."""
    tree = report["fallback_tree"]
    if not args.dry_run:
        config = MedusaConfig.load(heads_dir)
        config.tree = tree
        config.save(heads_dir)
        print(f"wrote the fallback tree {json.dumps(tree)} to {heads_dir / 'medusa_config.json'}")
    if args.save_tree:
        Path(args.save_tree).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_tree).write_text(json.dumps({"choices": tree}) + "\n")
        print(f"wrote {args.save_tree}")
    report["written"] = not args.dry_run
    out = Path(args.out) if args.out else heads_dir / REPORT_NAME
    if args.out or not args.dry_run:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
