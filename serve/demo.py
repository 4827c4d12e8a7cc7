"""make demo: a target (the default one + its bundled heads unless told) on a few chat prompts, plain generate vs
medusa_lite."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from medusa_lite.settings import SettingsParser, TargetOptions, option
from medusa_lite.specbench import chat_prompt
from medusa_lite.targets import load_model

PROMPTS = [
    "What are three tips for staying healthy?",
    "Write a short Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]


@dataclass
class DemoSettings(TargetOptions):
    """``medusa-lite demo`` settings: these defaults < ``--config FILE`` < flags."""

    max_new_tokens: int = option(128, "new tokens per prompt")
    heads: str | None = option(None, "heads directory, bundled drafter name or Hub repo id"
                               " (default: the bundled default)")
    fit: bool = option(True, "fit the tree to this machine; --no-fit: the heads' stored tree")
    threads: int | None = option(None, "torch.set_num_threads (default: torch's choice, every core; on a machine "
                                       "another process keeps busy, fewer threads than cores avoid oversubscription)")


def parse_args(argv: list[str] | None = None) -> DemoSettings:
    return SettingsParser(DemoSettings, prog="medusa-lite demo", description=__doc__, kind="demo").parse(argv)[0]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def guard_summary(fit, fitted: dict) -> str:
    """What the guard did in the last answer: the fitted tree's predicted speed, the realized speed of the answer's
    steps (every rung the guard ran, the root alone included) and how many steps each rung took."""
    realized = fitted["realized_tokens_per_second"][0]
    steps = sorted(fitted["steps_by_tree"].items(), key=lambda kv: -kv[1])
    rungs = ", ".join(f"{'root alone' if tree == '[]' else tree}: {n}" for tree, n in steps)
    return (f"fitted tree, short contexts: predicted {fit.ladders[0][0].tokens_per_second:.1f} tok/s, realized "
            f"{realized or 0:.1f} tok/s over the last answer's steps (steps per tree, as the guard chose: {rungs})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv).resolve()  # the summary names the dtype that ran
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(heads=args.heads, **args.load_kwargs())
    model.fit_enabled = args.fit
    fit = model.fit_hardware() if args.fit else None
    print(fit.report() if fit else "tree: the heads' stored tree (no hardware fit)")
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    warm = chat_prompt(tok, "Hi").to(model.device)
    model.generate(warm, max_new_tokens=8)  # warm-up, excluded
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    accepted, identical = [], 0
    for i, prompt in enumerate(PROMPTS, 1):
        ids = chat_prompt(tok, prompt).to(model.device)
        ref, t_plain = timed(lambda: model.base_model.generate(ids, **gen))
        out, t_medusa = timed(lambda: model.generate(ids, **gen))
        n_ref, n_out = ref.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1]
        totals["plain"][0] += n_ref; totals["plain"][1] += t_plain
        totals["medusa"][0] += n_out; totals["medusa"][1] += t_medusa
        accepted.append(model.last_stats.mean_accepted_tokens)
        same = torch.equal(ref, out)
        identical += same
        print(f"\n[{i}] user: {prompt}\nassistant: {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}")
        print(f"    plain {n_ref / t_plain:.1f} tok/s | medusa_lite {n_out / t_medusa:.1f} tok/s | "
              f"{accepted[-1]:.2f} tokens/forward | identical to plain: {same}")
    if fit is not None:
        print("\n" + guard_summary(fit, model.last_stats.fitted))
    plain_tps = totals["plain"][0] / totals["plain"][1]
    medusa_tps = totals["medusa"][0] / totals["medusa"][1]
    print(f"\nsummary ({args.dtype}, greedy, {args.max_new_tokens} new tokens): plain generate {plain_tps:.1f} tok/s, "
          f"medusa_lite {medusa_tps:.1f} tok/s ({medusa_tps / plain_tps:.2f}x), "
          f"mean accepted tokens per forward {sum(accepted) / len(accepted):.2f}, "
          f"identical outputs {identical}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
