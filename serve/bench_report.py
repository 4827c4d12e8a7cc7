"""``medusa-lite bench``'s report: ``results.md`` (tables), ``speedup.png`` and ``acceptance.png`` beside
``results.json``."""

from __future__ import annotations

import json
from pathlib import Path

from medusa_lite.serve.compare import markdown as paired_markdown

LABELS = {"plain": "plain generate", "pld": "prompt lookup", "medusa": "medusa_lite", "loop": "no-tree loop",
          "stored": "stored tree", "vs": "medusa_lite (vs-heads)", "kernel": "plain, skinny kernel"}


def markdown(report: dict) -> str:
    cfg, methods = report["config"], report["config"]["methods"]
    lines = [f"# Spec-Bench: {cfg['target']} ({cfg['dtype']}, {cfg['decoding']}, max_new_tokens "
             f"{cfg['max_new_tokens']}, {cfg['questions_per_task']} questions/task)", "",
             f"heads: {cfg['heads']}; tree: {cfg['tree_nodes']} nodes; torch threads {cfg['threads']}; "
             f"{cfg['machine']}; load average at the end {cfg.get('load_average')}", ""]
    head = ["task", "n"] + [f"{LABELS[m]} tok/s" for m in methods]
    head += [f"{LABELS[m]} speedup" for m in methods if m != "plain"]
    head += [f"{LABELS[m]} tok/fwd" for m in methods if m != "plain"]
    if cfg["decoding"] == "greedy":
        head += [f"{LABELS[m]} exact" for m in methods if m != "plain"]
    head += ["wall s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, s in report["summary"].items():
        cells = [task, str(s["questions"])] + [f"{s[m]['tokens_per_second']:.1f}" for m in methods]
        cells += [_fmt(s[m]["speedup"], "{:.2f}x") for m in methods if m != "plain"]
        cells += [f"{s[m]['mean_accepted_tokens']:.2f}" for m in methods if m != "plain"]
        if cfg["decoding"] == "greedy":
            cells += [_fmt(s[m]["exact_match"], "{:.0%}") for m in methods if m != "plain"]
        cells += [f"{sum(s[m]['wall_time'] for m in methods):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    fit = cfg.get("fit")
    if fit:
        from medusa_lite.machine import describe
        lines += ["", f"tree fitted to this machine ({describe(fit['fingerprint'])}), per context bucket:", "",
                  "| context | fitted tree | predicted tok/s | realized tok/s (speculative steps) | plain predicted tok/s |",
                  "|---|---|---|---|---|"]
        for row in fit["buckets"]:
            lines.append(f"| {row['context']} | `{json.dumps(row['tree'])}` | {row['predicted_tokens_per_second']:.1f} | "
                         f"{_fmt(row['realized_tokens_per_second'], '{:.1f}')} | "
                         f"{row['predicted_plain_tokens_per_second']:.1f} |")
        total = sum(fit["steps_by_tree"].values()) or 1
        lines += ["", "steps per tree (the guard moves off the fitted tree when it does not pay): "
                  + "; ".join(f"`{t}` {n / total:.0%}" for t, n in sorted(fit["steps_by_tree"].items(),
                                                                         key=lambda kv: -kv[1]))]
    if report.get("paired"):
        lines += ["", "the two drafters paired question by question (each one's speedup over plain generate):", "",
                  paired_markdown(report["paired"], (cfg["heads"], cfg["vs_heads"]))]
    if "medusa" in methods:
        depth = max(len(s["medusa"]["acceptance_per_depth"]) for s in report["summary"].values())
        lines += ["", "medusa_lite acceptance per depth (share of verify steps that accepted at least d drafted tokens):",
                  "", "| task | " + " | ".join(f"d={d + 1}" for d in range(depth)) + " |",
                  "|---|" + "---|" * depth]
        for task, s in report["summary"].items():
            acc = s["medusa"]["acceptance_per_depth"] + [0.0] * depth
            lines.append(f"| {task} | " + " | ".join(f"{a:.2f}" for a in acc[:depth]) + " |")
    if cfg["decoding"] == "greedy":
        mm = report["mismatches"]
        lines += ["", f"greedy outputs differing from plain decoding: {len(mm)}"]
        lines += [f"- question {m['question_id']} ({m['task']}), {LABELS[m['method']]}: first difference at "
                  f"token {m['first_difference']}, target logit gap {_fmt(m['logit_gap'], '{:.3f}')}" for m in mm]
        if mm:
            lines += ["", "(logit gap: the target's logit of plain's token minus that of the method's token at the "
                      "first difference; near 0 = a floating-point near-tie, expected in bf16)"]
    lines += ["", "tok/s: generated tokens / wall time; speedup: mean over questions of (method tok/s) / "
              "(plain tok/s); tok/fwd: generated tokens per target forward, bonus included (prefill counted); "
              "exact: share of questions whose output equals plain greedy decoding token for token.", ""]
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def plot(report: dict, out: Path) -> list[str]:
    """speedup.png (speedup per task per method) and acceptance.png (medusa_lite acceptance per depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    methods = [m for m in report["config"]["methods"] if m != "plain"]
    tasks = list(report["summary"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [t + i * width for t in range(len(tasks))]
        ax.bar(xs, [report["summary"][t][m]["speedup"] or 0.0 for t in tasks], width, label=LABELS[m])
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([t + width * (len(methods) - 1) / 2 for t in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("speedup vs plain generate")
    ax.set_title(f"Spec-Bench speedup ({report['config']['dtype']}, {report['config']['decoding']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)
    written.append("speedup.png")
    if "medusa" in methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in tasks:
            acc = report["summary"][t]["medusa"]["acceptance_per_depth"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=t, lw=2.5 if t == "overall" else 1)
        ax.set_xticks(range(1, 1 + max(len(report["summary"][t]["medusa"]["acceptance_per_depth"]) for t in tasks)))
        ax.set_xlabel("depth d")
        ax.set_ylabel("share of steps accepting >= d drafted tokens")
        ax.set_ylim(0, 1)
        ax.set_title("medusa_lite acceptance per depth")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=100)
        plt.close(fig)
        written.append("acceptance.png")
    return written


def save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["files"] = ["results.json", "results.md"] + plot(report, out)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results.md").write_text(markdown(report))
