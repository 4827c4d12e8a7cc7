"""Run in medusa_lite's venv, for ``make peer-bench``: transformers' plain ``generate`` and medusa_lite's on the same
Spec-Bench questions as .ci/peer_vllm.py, greedy, fp32, one thread: one request at a time (plain and medusa_lite
alternating per question) and all at once (a left-padded batch). Prints one JSON object.

    python .ci/peer_ours.py QUESTIONS_JSONL N MAX_TOKENS [EAGLE3_DIR]
"""

import json
import sys
import time

import torch
from vllm_check import picked_chats

from medusa_lite import MedusaModel
from medusa_lite.targets import load_model


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
    return ids, mask


def batch1(runs: dict, prompts: list[torch.Tensor], max_tokens: int) -> dict[str, tuple[list[list[int]], float]]:
    """Each question decoded by every run in turn (side by side, so machine noise falls on all alike)."""
    out = {name: ([], 0.0) for name in runs}
    for p in prompts:
        for name, generate in runs.items():
            t0 = time.perf_counter()
            ids = generate(p[None], max_new_tokens=max_tokens, do_sample=False)[0, p.numel():].tolist()
            outputs, seconds = out[name]
            out[name] = (outputs + [ids], seconds + time.perf_counter() - t0)
    return out


def strip(row: list[int], eos: set[int], pad: int) -> list[int]:
    """A row's tokens up to and including its first EOS (what one request returns)."""
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def main():
    questions, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    model, tok = load_model(None, None, dtype="fp32")
    target = model.base_model
    prompts = [tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                       return_dict=True)["input_ids"][0] for chat in picked_chats(questions, n)]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    model.generate(prompts[0][None], max_new_tokens=8)  # the fit (probe, or its cache) and a warm-up
    target.generate(prompts[0][None], max_new_tokens=8, do_sample=False)
    runs = {"transformers plain generate": target.generate, "medusa_lite generate (bundled default drafter, fitted)":
            model.generate}
    if len(sys.argv) > 4:
        eagle3 = MedusaModel.from_pretrained(target, sys.argv[4])
        runs[f"medusa_lite generate ({sys.argv[4]}, its stored tree)"] = eagle3.generate
    rows = []
    alone = batch1(runs, prompts, max_tokens)
    for name, generate in runs.items():
        outputs, seconds = alone[name]
        ids, mask = left_padded(prompts, tok.pad_token_id or 0)
        t0 = time.perf_counter()
        together = generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False)[:, ids.shape[1]:]
        all_seconds = time.perf_counter() - t0
        together = [strip(r, eos, tok.pad_token_id) for r in together.tolist()]
        tokens = sum(map(len, outputs))
        rows.append({"name": name, "tokens": tokens, "batch1_tok_s": tokens / seconds, "batch1_seconds": seconds,
                     "all_at_once_tok_s": sum(map(len, together)) / all_seconds, "outputs": outputs})
    print(json.dumps({"engine": "medusa_lite", "threads": 1, "prompts": len(prompts), "max_tokens": max_tokens,
                      "rows": rows}))


if __name__ == "__main__":
    main()
