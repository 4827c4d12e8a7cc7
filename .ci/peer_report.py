"""``make peer-bench``'s report: the JSON of .ci/peer_vllm.py, .ci/peer_ours.py and the two servers' load tests as
markdown tables, with ratios against vLLM's plain decoding measured in the same run.

    python .ci/peer_report.py OUT_DIR
"""

import json
import platform
import sys
from pathlib import Path


def cpu() -> str:
    from medusa_lite.machine import hardware_summary

    return hardware_summary()


def generation_table(vllm: dict, ours: dict) -> list[str]:
    base = vllm["rows"][0]
    reference = next(r for r in ours["rows"] if r["name"].startswith("transformers"))
    lines = ["| engine, method | batch 1 tok/s | vs vLLM plain | vs vLLM n-gram | all at once tok/s | vLLM: 1 + accepted "
             "/ drafts | outputs equal to its engine's plain |", "|---|---|---|---|---|---|---|"]
    ngram = vllm["rows"][1]
    for r, plain in [(r, base) for r in vllm["rows"]] + [(r, reference) for r in ours["rows"]]:
        equal = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
        accept = r.get("mean_acceptance_length")
        lines.append(f"| {r['name']} | {r['batch1_tok_s']:.1f} | {r['batch1_tok_s'] / base['batch1_tok_s']:.2f}x | "
                     f"{r['batch1_tok_s'] / ngram['batch1_tok_s']:.2f}x | {r['all_at_once_tok_s']:.1f} | "
                     f"{accept if accept else '—'} | {equal}/{len(r['outputs'])} |")
    return lines


def server_table(servers: dict[str, dict]) -> list[str]:
    lines = ["| server | clients | total tok/s | TTFT p50 (s) | TTFT max (s) | client tok/s | tokens / step |",
             "|---|---|---|---|---|---|---|"]
    for name, data in servers.items():
        for r in data["rows"]:
            lines.append(f"| {name} | {r['clients']} | {r['total_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                         f"{r['ttft_max_s']:.2f} | {r['client_tok_s']:.1f} | {r['tokens_per_step']:.2f} |")
    return lines


def main():
    out = Path(sys.argv[1])
    vllm, ours = (json.loads((out / f"{n}.json").read_text()) for n in ("vllm", "ours"))
    servers = {name: json.loads((out / f"{key}-server.json").read_text())
               for key, name in (("vllm", "vLLM (plain)"), ("ours", "medusa_lite (bundled default drafter, fitted)"))
               if (out / f"{key}-server.json").is_file()}
    print(f"Machine: {cpu()} ({platform.machine()}); fp32, greedy; {ours['prompts']} Spec-Bench questions (the first "
          f"of each category), {ours['max_tokens']} new tokens; medusa_lite one torch thread, vLLM its own CPU "
          "binding (it computes on one core of two).\n")
    print("\n".join(generation_table(vllm, ours)))
    if servers:
        print("\nServers, streamed chat, `medusa-lite loadtest` (its 8 prompts, 1 request per client per level):\n")
        print("\n".join(server_table(servers)))


if __name__ == "__main__":
    main()
