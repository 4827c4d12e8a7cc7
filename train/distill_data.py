"""Self-distilled training data: the target's own greedy answers to ShareGPT prompts, as chat JSONL.

    medusa-lite distill-data --out runs/distill/sharegpt.jsonl --num-prompts 4000 [--shard 0/2]
    medusa-lite train --config smollm2-135m data=runs/distill/sharegpt.jsonl

Heads decode the target's text, not the human text of ShareGPT: trained on the target's own answers
(as Medusa-2 and EAGLE do), they see the hidden states and the token statistics they meet at decoding
time. Each line is ``{"messages": [user, assistant], "source_index": i}``; the file is appended to, so
an interrupted run continues where it stopped (rows already written are skipped).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from medusa_lite.settings import SettingsParser, option
from medusa_lite.train import data as D


@dataclass
class DistillSettings:
    """``medusa-lite distill-data`` settings: these defaults < ``--config FILE`` < flags."""

    out: str = option(help="output JSONL (appended to; resumable)")
    target: str | None = option(None, "HF directory or .gguf (default: the bundled default target)")
    prompts: str = option("sharegpt", "'sharegpt' or a chat .json/.jsonl file")
    num_prompts: int = option(4000, "prompts answered")
    skip_prompts: int = option(0, "start after this many prompts (disjoint sets)")
    max_prompt_tokens: int = option(384, "longer prompts are skipped")
    max_new_tokens: int = option(256, "answer length")
    batch_size: int = option(64, "prompts per batched generate")
    dtype: Literal["bf16", "fp32"] = option("bf16", "target dtype")
    threads: int | None = option(None, "torch.set_num_threads")
    shard: str = option("0/1", "i/n: this process takes every n-th prompt from the i-th")
    seed: int = option(0, "seed of the prompt order")


def parse_args(argv: list[str] | None = None) -> DistillSettings:
    return SettingsParser(DistillSettings, prog="medusa-lite distill-data", description=__doc__,
                          kind="distill-data").parse(argv)[0]


def first_user_turns(path: Path, *, limit: int, skip: int, seed: int) -> list[tuple[int, str]]:
    """(index, text) of the first user turn of the first ``skip + limit`` valid records, minus ``skip``."""
    records, _ = D.read_records(path, limit=skip + limit, seed=seed)
    out = []
    for i, rec in enumerate(records[skip:], start=skip):
        user = next((m["content"] for m in rec["messages"] if m["role"] == "user"), None)
        if user and user.strip():
            out.append((i, user))
    return out


@torch.no_grad()
def answer_batch(target, tokenizer, texts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of the target to one-turn chats, batched with left padding."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in texts]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    out = target.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                          cache_implementation="static")  # a growing cache re-copies [B, L] K/V every step
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from medusa_lite.targets import load_target

    shard, shards = (int(x) for x in args.shard.split("/"))
    target, tokenizer = load_target(args.target, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = first_user_turns(D.resolve_data_path(args.prompts), limit=args.num_prompts, skip=args.skip_prompts,
                               seed=args.seed)[shard::shards]
    lengths = {i: len(tokenizer(t, add_special_tokens=False)["input_ids"]) for i, t in prompts}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["source_index"] for line in out.read_text().splitlines() if line.strip()} \
        if out.is_file() else set()
    todo = sorted(((i, t) for i, t in prompts if i not in done and lengths[i] <= args.max_prompt_tokens),
                  key=lambda it: lengths[it[0]])
    print(f"distill: {len(todo)} prompts to answer ({len(done)} already in {out})", flush=True)
    t0, new_tokens = time.time(), 0
    with out.open("a") as f:
        for b in range(0, len(todo), args.batch_size):
            batch = todo[b: b + args.batch_size]
            answers = answer_batch(target, tokenizer, [t for _, t in batch], args.max_new_tokens)
            for (i, text), answer in zip(batch, answers):
                new_tokens += len(tokenizer(answer, add_special_tokens=False)["input_ids"])
                f.write(json.dumps({"messages": [{"role": "user", "content": text},
                                                 {"role": "assistant", "content": answer}],
                                    "source_index": i}) + "\n")
            f.flush()
            print(f"distill: {b + len(batch)}/{len(todo)} prompts, {new_tokens} answer tokens, "
                  f"{new_tokens / (time.time() - t0):.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
