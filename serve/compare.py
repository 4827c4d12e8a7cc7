"""medusa-lite compare: two ``medusa-lite bench`` reports of the same questions, paired question by question.

    medusa-lite compare runs/bench-a/results.json runs/bench-b/results.json

Each report's speedup of a question is its method's tokens/s over its own plain generate's (both measured in that
report's process), so two reports taken in different processes or on different cores still compare fairly. The
difference B - A is reported as a mean over questions with a bootstrap 95% interval (questions resampled), the
share of questions B wins, and the same on the questions whose outputs are the same in both reports: in bf16 a
verify forward and plain decoding round differently, outputs part at near-ties, and a question whose two texts
differ compares two different texts rather than two drafters.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from medusa_lite.settings import SettingsParser, option


@dataclass
class CompareSettings:
    """``medusa-lite compare`` settings."""

    method: str = option("medusa", "the method compared (each question's speedup over its report's plain)")
    resamples: int = option(10000, "bootstrap resamples of the questions")
    seed: int = option(0, "bootstrap seed")

    def __post_init__(self) -> None:
        if self.resamples < 1:
            raise ValueError("resamples must be >= 1")


def speedups(report: dict, method: str) -> dict[int, tuple[float, list[int]]]:
    """question id -> (method tok/s over plain tok/s, the method's output tokens)."""
    out = {}
    for row in report["questions"]:
        if method not in row["methods"]:
            raise ValueError(f"question {row['question_id']} has no {method!r} run")
        plain, run = row["methods"]["plain"], row["methods"][method]
        if plain["tokens_per_second"] > 0:
            out[row["question_id"]] = (run["tokens_per_second"] / plain["tokens_per_second"], run["tokens"])
    return out


def paired(a: dict[int, float], b: dict[int, float], resamples: int, seed: int) -> dict:
    """Mean speedups of A and B over their common questions, the mean of B - A with its bootstrap 95% interval, and
    how many questions B is faster on."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return {"questions": 0}
    diffs = [b[k] - a[k] for k in keys]
    n, rng = len(diffs), random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    low, high = means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]
    return {"questions": n, "a": sum(a[k] for k in keys) / n, "b": sum(b[k] for k in keys) / n,
            "diff": sum(diffs) / n, "ci95": [low, high], "b_wins": sum(d > 0 for d in diffs)}


def compare(report_a: dict, report_b: dict, method: str, resamples: int, seed: int, method_b: str | None = None) -> dict:
    """:func:`paired` over every common question, and over those whose outputs are the same in both reports.
    ``method_b``: B's method when it is not A's (two drafters in one ``bench --vs-heads`` report)."""
    a, b = speedups(report_a, method), speedups(report_b, method_b or method)
    same = {k for k in set(a) & set(b) if a[k][1] == b[k][1]}
    result = {}
    for label, keys in (("all", set(a) & set(b)), ("same_output", same)):
        result[label] = paired({k: a[k][0] for k in keys}, {k: b[k][0] for k in keys}, resamples, seed)
    return result


def markdown(result: dict, names: tuple[str, str]) -> str:
    lines = [f"A = {names[0]}", f"B = {names[1]}", "",
             "| questions | n | A speedup | B speedup | B - A | 95% interval | B faster on |", "|---|---|---|---|---|---|---|"]
    for label, r in (("all", result["all"]), ("same output in both", result["same_output"])):
        if r["questions"]:
            lines.append(f"| {label} | {r['questions']} | {r['a']:.3f}x | {r['b']:.3f}x | {r['diff']:+.3f} | "
                         f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}] | {r['b_wins']}/{r['questions']} |")
        else:
            lines.append(f"| {label} | 0 | - | - | - | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = SettingsParser(CompareSettings, prog="medusa-lite compare", description=__doc__)
    parser.add_argument("report_a", help="results.json of medusa-lite bench (A)")
    parser.add_argument("report_b", help="results.json of medusa-lite bench (B), the same questions")
    args, paths = parser.parse(argv)
    reports = [json.loads(Path(p).read_text()) for p in (paths.report_a, paths.report_b)]
    result = compare(*reports, args.method, args.resamples, args.seed)
    print(markdown(result, (paths.report_a, paths.report_b)))
    return result


if __name__ == "__main__":
    main()
