"""medusa-lite bench: the Spec-Bench protocol (docs/benchmark.md) -- plain generate vs prompt lookup vs medusa_lite.

    medusa-lite bench                                   # all 480 questions, 256 new tokens, greedy, fp32 (CPU)
    medusa-lite bench --limit 5 --max-new-tokens 128    # quick: the first 5 questions of each task
    medusa-lite bench --temperature 1.0 --dtype bf16 --methods plain,medusa
    medusa-lite bench --limit 5 --methods plain,medusa --heads A --vs-heads B   # two drafters, paired

Batch size 1, the chat template, the first turn of every question (MT-bench's second turns are not
run), in one process; per question the methods run back to back in a rotating order, each from the
same prompt. A warm-up generation per method is excluded. ``--vs-heads`` adds a second drafter on the same
target (method ``vs``), run beside ``medusa`` question by question and paired with it as ``medusa-lite compare``
pairs two reports: the fair way to tell two drafters apart on a machine whose speed drifts. Outputs in ``--out``:
``results.json`` (every question and the summaries), ``results.md`` (tables), ``speedup.png`` and
``acceptance.png`` (:mod:`medusa_lite.serve.bench_report`).
Timings are whatever this machine gives; the report never judges them.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_lite import MedusaModel
from medusa_lite.attention import attending
from medusa_lite.kernels import SkinnyLinears, attention_kernel, skinny_kernel
from medusa_lite.sampling import eos_ids
from medusa_lite.serve.bench_report import markdown, save
from medusa_lite.serve.compare import compare
from medusa_lite.settings import Names, SettingsParser, TargetOptions, option
from medusa_lite.specbench import DEFAULT_QUESTIONS, TASKS, chat_prompt, load_questions
from medusa_lite.targets import describe_heads, load_model
from medusa_lite.tree import load_tree, parse_tree, tree_json, tree_nodes

METHODS = ("plain", "pld", "medusa", "loop", "stored", "vs", "kernel")
DEFAULT_METHODS = ("plain", "pld", "medusa")
# loop: medusa_lite's decoding loop with the root alone (tree []), no speculation. Opt-in reference: how
# much of medusa_lite's speedup over plain ``generate`` is the loop itself rather than the tree.
# stored: medusa_lite with the heads' stored tree instead of the tree fitted to this machine (opt-in reference)
# vs: medusa_lite with the second drafter, --vs-heads (added to the methods by that option)
DRAFTED = ("medusa", "vs")  # methods whose generate calls report acceptance statistics


# ------------------------------------------------------------------------------------------ parse
@dataclass
class BenchSettings(TargetOptions):
    """``medusa-lite bench`` settings: these defaults < ``--config FILE`` < flags."""

    questions: str = option(str(DEFAULT_QUESTIONS), "Spec-Bench question.jsonl (default: the copy shipped with "
                                                    "medusa_lite)")
    heads: str | None = option(None, "heads directory, bundled drafter name or Hub repo id"
                               " (default: the bundled default, else fresh heads)")
    vs_heads: str | None = option(None, "a second drafter (directory, bundled name or Hub repo id) on the same "
                                        "target, run as method vs beside medusa and paired with it per question")
    tree: str | None = option(None, "tree JSON file or a shipped tree name (default: the tree fitted to this machine)")
    fit: bool = option(True, "fit the tree to this machine; --no-fit: the heads' stored tree")
    max_new_tokens: int = option(256, "new tokens per question")
    limit: int | None = option(None, "questions per task (default: all 80)")
    tasks: Names = option(Names(TASKS), "Spec-Bench tasks")
    temperature: float = option(0.0, "0 = greedy (default); e.g. 1.0 to sample")
    methods: Names = option(Names(DEFAULT_METHODS), f"subset of {','.join(METHODS)} (loop: medusa_lite with no "
                                                    "tree, a reference; kernel: plain decoding with the target's "
                                                    "linears through medusa_lite's skinny kernel (and its packed "
                                                    "single-query attention), what the kernel "
                                                    "alone gives); plain is always run")
    prompt_lookup_tokens: int = option(10, "prompt_lookup_num_tokens for pld")
    seed: int = option(0, "sampling seed")
    threads: int | None = option(None, "torch.set_num_threads (default: torch's choice)")
    out: str = option("runs/bench", "output directory")

    def __post_init__(self) -> None:
        bad = sorted(set(self.methods) - set(METHODS))
        if bad or not self.methods:
            raise ValueError(f"methods: unknown {bad}; choose from {','.join(METHODS)}")
        if "plain" not in self.methods:  # the reference every speedup and exact-match is measured against
            self.methods = Names(("plain", *self.methods))
        if self.vs_heads and "vs" not in self.methods:
            self.methods = Names((*self.methods, "vs"))
        if "vs" in self.methods and not self.vs_heads:
            raise ValueError("method vs runs the drafter given by --vs-heads; none was given")
        if "kernel" in self.methods and skinny_kernel() is None:
            raise ValueError("method kernel needs medusa_lite's skinny kernel, which did not build here (it needs "
                             "an AVX2 CPU, a C++ compiler and MEDUSA_LITE_SKINNY unset)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


def parse_args(argv: list[str] | None = None) -> BenchSettings:
    parser = SettingsParser(BenchSettings, prog="medusa-lite bench", description=__doc__, kind="bench")
    return parser.parse(argv)[0]


def generation_kwargs(args: BenchSettings, tokenizer, target) -> dict:
    """Decoding options shared by every method: greedy, or pure sampling at the given temperature."""
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(eos_ids(target.generation_config)), tokenizer.pad_token_id)
    kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    if args.temperature == 0:
        return kwargs | dict(do_sample=False)
    return kwargs | dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)


class ForwardCounter:
    """Counts target forward calls (a forward hook), to report tokens per forward for every method."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def make_runners(drafters: dict[str, MedusaModel], gen: dict, pld_tokens: int) -> dict:
    """method -> fn(input_ids) -> output ids [1, L + n]. ``drafters``: as :func:`build_drafters` makes them."""
    model = drafters["medusa"]
    target = model.base_model

    def plain(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), **gen)

    def pld(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=pld_tokens, **gen)

    def medusa(ids):
        return model.generate(ids, **gen)

    def loop(ids):
        return model.generate(ids, tree=[], **gen)

    def stored(ids):
        return model.generate(ids, fit=False, **gen)

    def vs(ids):
        return drafters["vs"].generate(ids, **gen)

    fast = None

    def kernel(ids):  # plain decoding through medusa_lite's kernels: every linear skinny, the single query packed
        nonlocal fast
        fast = fast or SkinnyLinears(target)
        with fast, attending(target, single_query=True, small=attention_kernel()):
            return target.generate(ids, attention_mask=torch.ones_like(ids), **gen)

    return {"plain": plain, "pld": pld, "medusa": medusa, "loop": loop, "stored": stored, "vs": vs, "kernel": kernel}


# -------------------------------------------------------------------------------------------- run
def run_question(runners: dict, methods: list[str], drafters: dict[str, MedusaModel], counter: ForwardCounter, ids,
                 seed: int, order_shift: int) -> dict:
    """Run every method on one prompt, in an order rotated by ``order_shift``. -> {method: record}.
    ``drafters``: method -> the MedusaModel whose ``last_stats`` that method's record takes."""
    order = methods[order_shift % len(methods):] + methods[:order_shift % len(methods)]
    records = {}
    for method in order:
        torch.manual_seed(seed)
        calls = counter.calls
        t0 = time.perf_counter()
        out = runners[method](ids)
        seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        rec = {"new_tokens": len(new), "seconds": seconds, "tokens_per_second": len(new) / seconds,
               "target_forwards": counter.calls - calls, "tokens": new}
        if method in drafters:
            stats = drafters[method].last_stats
            rec.update(accepted_per_depth=list(stats.accepted_per_depth), verify_steps=stats.verify_steps,
                       target_time=stats.target_time, overhead_share=stats.overhead_share, fitted=stats.fitted)
        records[method] = rec
    return records


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two sequences (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------- summary
def summarize(rows: list[dict], methods: list[str], greedy: bool) -> dict:
    """Per-method aggregates over question rows (each ``{"question_id", "task", "methods": {m: record}}``)."""
    out = {"questions": len(rows)}
    for m in methods:
        recs = [r["methods"][m] for r in rows]
        tokens, seconds = sum(x["new_tokens"] for x in recs), sum(x["seconds"] for x in recs)
        forwards = sum(x["target_forwards"] for x in recs)
        s = {"new_tokens": tokens, "wall_time": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
             "target_forwards": forwards, "mean_accepted_tokens": tokens / forwards if forwards else 0.0}
        ratios = [r["methods"][m]["tokens_per_second"] / r["methods"]["plain"]["tokens_per_second"]
                  for r in rows if r["methods"]["plain"]["tokens_per_second"] > 0]
        s["speedup"] = sum(ratios) / len(ratios) if ratios else None
        if greedy and m != "plain":
            same = [r["methods"][m]["tokens"] == r["methods"]["plain"]["tokens"] for r in rows]
            s["exact_match"] = sum(same) / len(same) if same else None
        if m in DRAFTED:
            steps = sum(x["verify_steps"] for x in recs)
            depth = max((len(x["accepted_per_depth"]) for x in recs), default=0)
            per_depth = [sum(x["accepted_per_depth"][d] for x in recs if d < len(x["accepted_per_depth"]))
                         for d in range(depth)]
            s["acceptance_per_depth"] = [n / steps if steps else 0.0 for n in per_depth]
            s["overhead_share"] = sum(x["overhead_share"] for x in recs) / len(recs) if recs else 0.0
        out[m] = s
    return out


@torch.no_grad()
def mismatches(row: dict, methods: list[str], target, ids: torch.Tensor) -> list[dict]:
    """Greedy outputs of one question that differ from plain decoding.

    For each: the first differing position and ``logit_gap``, the target's logit of plain's token minus
    that of the method's token there (one uncached forward over prompt + plain's prefix). A gap near 0 is
    a floating-point near-tie (the two computations round differently), not a wrong acceptance rule.
    """
    found = []
    ref = row["methods"]["plain"]["tokens"]
    for m in methods:
        if m == "plain":
            continue
        other = row["methods"][m]["tokens"]
        pos = first_difference(ref, other)
        if pos is None:
            continue
        gap = None
        if pos < len(ref) and pos < len(other):
            prefix = torch.cat([ids[0], torch.tensor(ref[:pos], dtype=ids.dtype, device=ids.device)])[None]
            logits = target(input_ids=prefix, use_cache=False).logits[0, -1].float()
            gap = float(logits[ref[pos]] - logits[other[pos]])
        found.append({"question_id": row["question_id"], "task": row["task"], "method": m,
                      "first_difference": pos, "logit_gap": gap, "plain_tokens": len(ref),
                      "method_tokens": len(other)})
    return found


def fit_summary(fit, rows: list[dict], method: str = "medusa") -> dict:
    """The fit (machine, tree per context bucket, predicted tok/s) with medusa_lite's realized tok/s in its
    speculative steps per bucket, and how often each tree was used (the guard may move off the fitted one)."""
    summary = fit.summary()
    tokens = [0.0] * len(fit.ladders)
    seconds = [0.0] * len(fit.ladders)
    steps: dict[str, int] = {}
    for r in rows:
        fitted = r["methods"].get(method, {}).get("fitted")
        if not fitted:
            continue
        for b, (t, s) in enumerate(fitted.get("realized", [])):
            tokens[b] += t
            seconds[b] += s
        for tree, n in fitted["steps_by_tree"].items():
            steps[tree] = steps.get(tree, 0) + n
    for b, row in enumerate(summary["buckets"]):
        row["realized_tokens_per_second"] = tokens[b] / seconds[b] if seconds[b] else None
    summary["steps_by_tree"] = steps
    return summary


# ------------------------------------------------------------------------------------------- main
def run_all(args: BenchSettings, drafters: dict, tokenizer, questions, runners, counter) -> tuple[list, list, float]:
    """A warm-up (excluded), then every question with every method: (rows, greedy mismatches, wall seconds)."""
    greedy = args.temperature == 0
    model = drafters["medusa"]
    warm = chat_prompt(tokenizer, "Hello!").to(model.device)
    for m in args.methods:
        runners[m](warm)
    rows, diffs = [], []
    start = time.perf_counter()
    bar = tqdm(questions, desc="spec-bench", unit="q")
    for i, q in enumerate(bar):
        ids = chat_prompt(tokenizer, q.prompt).to(model.device)
        recs = run_question(runners, args.methods, drafters, counter, ids, seed=args.seed * 100_003 + q.question_id,
                            order_shift=i)
        rows.append({"question_id": q.question_id, "task": q.task, "prompt_tokens": ids.shape[1], "methods": recs})
        if greedy:
            diffs += mismatches(rows[-1], args.methods, model.base_model, ids)  # after timing: not in any wall time
        bar.set_postfix({m: f"{recs[m]['tokens_per_second']:.1f}t/s" for m in args.methods})
    return rows, diffs, time.perf_counter() - start


def prepare_drafter(model: MedusaModel, args: BenchSettings, greedy: bool):
    """Set a drafter's tree (``--tree``: as the model's tree, not generate(tree=...), so drafting proposes enough
    ranks for it) or fit one to this machine; -> the fit, or None."""
    if args.tree:
        model.config.tree = tree_json(parse_tree(load_tree(args.tree), model.config.num_heads))
    model.fit_enabled = args.fit and not args.tree
    fit = model.fit_hardware(sample=not greedy) if model.fit_enabled else None
    if fit is not None:
        print(fit.report())
    return fit


def build_drafters(args: BenchSettings, greedy: bool) -> tuple[dict, dict, object]:
    """The drafter(s) on one target, ``{"medusa": model}`` and ``"vs"`` with ``--vs-heads``; their fits; the
    tokenizer."""
    model, tokenizer = load_model(heads=args.heads, **args.load_kwargs())
    drafters = {"medusa": model}
    if args.vs_heads:
        drafters["vs"] = MedusaModel.from_pretrained(model.base_model, args.vs_heads)
    return drafters, {method: prepare_drafter(m, args, greedy) for method, m in drafters.items()}, tokenizer


def main(argv: list[str] | None = None) -> dict:
    # parse
    args = parse_args(argv).resolve()  # the report names the device and dtype that ran
    if args.threads:
        torch.set_num_threads(args.threads)
    greedy = args.temperature == 0

    # build: the drafter(s) on one target
    drafters, fits, tokenizer = build_drafters(args, greedy)
    model, fit = drafters["medusa"], fits["medusa"]
    target = model.base_model
    choices = model.tree_for(sample=args.temperature > 0)
    questions = load_questions(args.questions, limit=args.limit, tasks=args.tasks)
    if not questions:
        raise SystemExit(f"no questions for tasks {args.tasks} in {args.questions}")
    gen = generation_kwargs(args, tokenizer, target)
    runners = make_runners(drafters, gen, args.prompt_lookup_tokens)
    counter = ForwardCounter(target)

    # run: warm-up (excluded), then every question with every method
    rows, diffs, total = run_all(args, drafters, tokenizer, questions, runners, counter)

    # save
    summary = {t: summarize([r for r in rows if r["task"] == t], args.methods, greedy)
               for t in args.tasks if any(r["task"] == t for r in rows)}
    summary["overall"] = summarize(rows, args.methods, greedy)
    report = {
        "config": {
            "target": args.target or "SmolLM2-135M-Instruct", "revision": args.revision, "heads": describe_heads(model),
            "vs_heads": describe_heads(drafters["vs"]) if "vs" in drafters else None, "dtype": args.dtype,
            "decoding": "greedy" if greedy else f"sampling T={args.temperature}", "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens, "questions_per_task": args.limit or "all",
            "tasks": args.tasks, "turns": "first turn only", "methods": args.methods, "seed": args.seed,
            "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
            "tree": "fitted to this machine" if fit else tree_json(choices),
            "tree_nodes": "per context bucket" if fit else tree_nodes(choices),
            "fit": fit_summary(fit, rows) if fit else None,
            "vs_fit": fit_summary(fits["vs"], rows, "vs") if fits.get("vs") else None,
            "questions_file": str(args.questions), "threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()],  # other processes skew timings
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "device": args.device,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "command": " ".join(["medusa-lite bench"] + (sys.argv[1:] if argv is None else list(argv))),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "summary": summary,
        "mismatches": diffs if greedy else None,
        "total_wall_time": total,
        "questions": rows,
    }
    if "vs" in drafters:  # the two drafters paired question by question (B = vs-heads)
        report["paired"] = compare(report, report, "medusa", resamples=10_000, seed=0, method_b="vs")
    out = Path(args.out)
    save(report, out)
    print(markdown(report))
    print(f"wrote {', '.join(str(out / f) for f in report['files'])}")
    return report


if __name__ == "__main__":
    main()
