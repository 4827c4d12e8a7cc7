"""make demo: the default target + bundled heads on a few chat prompts, plain generate vs medusa_lite."""

from __future__ import annotations

import argparse
import time

import torch

import medusa_lite
from medusa_lite.specbench import chat_prompt
from medusa_lite.targets import has_bundled_heads

PROMPTS = [
    "What are three tips for staying healthy?",
    "Write a short Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--heads", default=None, help="heads directory (default: the bundled heads)")
    p.add_argument("--no-fit", dest="fit", action="store_false",
                   help="decode with the heads' stored tree instead of the tree fitted to this machine")
    return p.parse_args()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model, tok = medusa_lite.load_default(dtype=args.dtype, heads=args.heads)
    if args.heads is None and not has_bundled_heads():
        print("NOTE: no trained heads ship yet: using fresh (zero-initialised) heads, so expect ~1 token/forward.")
    model.fit_enabled = args.fit
    fit = model.fit_hardware() if args.fit else None
    print(fit.report() if fit else "tree: the heads' stored tree (no hardware fit)")
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    warm = chat_prompt(tok, "Hi")
    model.generate(warm, max_new_tokens=8)  # warm-up, excluded
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    accepted, identical = [], 0
    for i, prompt in enumerate(PROMPTS, 1):
        ids = chat_prompt(tok, prompt)
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
        realized = model.last_stats.fitted["realized_tokens_per_second"][0]
        print(f"\nfitted tree, short contexts: predicted {fit.ladders[0][0].tokens_per_second:.1f} tok/s, "
              f"realized {realized or 0:.1f} tok/s in the last answer's speculative steps")
    plain_tps = totals["plain"][0] / totals["plain"][1]
    medusa_tps = totals["medusa"][0] / totals["medusa"][1]
    print(f"\nsummary ({args.dtype}, greedy, {args.max_new_tokens} new tokens): plain generate {plain_tps:.1f} tok/s, "
          f"medusa_lite {medusa_tps:.1f} tok/s ({medusa_tps / plain_tps:.2f}x), "
          f"mean accepted tokens per forward {sum(accepted) / len(accepted):.2f}, "
          f"identical outputs {identical}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
