"""Self-distilled training data: the target's own greedy answers to ShareGPT prompts, as chat JSONL.

    medusa-lite distill-data --out runs/distill/sharegpt.jsonl --num-prompts 4000 [--shard 0/2]
    medusa-lite train --config smollm2-135m data=runs/distill/sharegpt.jsonl

    medusa-lite distill-data --out runs/distill/mix.jsonl --mix chat,multi,summarize,translate,passage,arithmetic,code

Heads decode the target's text, not the human text of ShareGPT: trained on the target's own answers
(as Medusa-2 and EAGLE do), they see the hidden states and the token statistics they meet at decoding
time. ``--mix`` takes prompt kinds in turn, record by record: first turns (chat), a second turn after the first
exchange (multi), summarize / translate / answer-from-this-passage tasks on ShareGPT answer text, step-by-step
arithmetic, code questions, and passages to continue (:func:`build_prompt`). Each line is ``{"messages": [...,
assistant], "source_index": i, "kind": k}``. A target without a chat template (a base model) continues the prompt's
text instead (the turns joined by blank lines; ``--mix continue,summarize,passage`` suits it), and its lines are
``{"text": prompt + continuation, "prompt_chars": len(prompt), ...}``: training learns the continuation. The file is
appended to, so an interrupted run continues where it stopped
(rows already written are skipped). Spec-Bench questions are never among the prompts.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_lite.settings import Names, SettingsParser, TargetOptions, option
from medusa_lite.train import data as D


KINDS = ("chat", "multi", "summarize", "translate", "passage", "arithmetic", "code", "continue")


@dataclass
class DistillSettings(TargetOptions):
    """``medusa-lite distill-data`` settings: these defaults < ``--config FILE`` < flags."""

    out: str = option(help="output JSONL (appended to; resumable)")
    prompts: str = option("sharegpt", "'sharegpt' or a chat .json/.jsonl file")
    num_prompts: int = option(4000, "prompts answered")
    skip_prompts: int = option(0, "start after this many prompts (disjoint sets)")
    max_prompt_tokens: int = option(1024, "longer prompts are skipped")
    max_new_tokens: int = option(256, "answer length")
    batch_size: int = option(64, "prompts per batched generate")
    threads: int | None = option(None, "torch.set_num_threads")
    shard: str = option("0/1", "i/n: this process takes every n-th prompt from the i-th")
    seed: int = option(0, "seed of the prompt order")
    time_limit_minutes: float | None = option(None, "stop after the batch that reaches this wall time (resume later)")
    mix: Names = option(Names(("chat",)), f"prompt kinds, taken in turn record by record: {', '.join(KINDS)}")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.mix) - set(KINDS))
        if unknown or not self.mix:
            raise ValueError(f"mix: unknown kinds {unknown}; choose from {', '.join(KINDS)}")


def parse_args(argv: list[str] | None = None) -> DistillSettings:
    return SettingsParser(DistillSettings, prog="medusa-lite distill-data", description=__doc__,
                          kind="distill-data").parse(argv)[0]


def _turns(rec: dict, role: str) -> list[str]:
    return [m["content"] for m in rec["messages"] if m["role"] == role and m["content"].strip()]


def _passage(rec: dict, words: int) -> str | None:
    """The first ``words`` words of the record's assistant answers, joined (ShareGPT text to work on).

    Long passages matter: summarizing, answering from and translating a text make the target copy from a long
    prompt, which first turns rarely do and which a drafter learns only from contexts that long."""
    text = " ".join(" ".join(_turns(rec, "assistant")).split()[:words])
    return text if len(text.split()) >= 20 else None


_CODE_WORDS = ("python", "function", "code", "javascript", "sql", "script", "class ", "program", "bash", "regex")


def _arithmetic(i: int) -> str:
    rng = random.Random(i)
    a, b, c = rng.randint(12, 999), rng.randint(2, 99), rng.randint(2, 999)
    op = rng.choice(["*", "+", "-"])
    return f"What is {a} {op} {b} + {c}? Work it out step by step, then give the answer."


PASSAGE_WORDS = {"summarize": 480, "passage": 360, "translate": 80}
CONTINUE_WORDS = (40, 120, 300)  # prefixes of several lengths: a continuation is drafted at every context length


def build_prompt(kind: str, i: int, rec: dict) -> list[dict] | None:
    """The chat ``kind`` makes of record ``i`` (None when the record does not suit it), the target to answer last.

    chat: the first user turn. multi: the first exchange, then the second user turn. summarize / translate /
    passage: a task on the text of the record's first answer. arithmetic: a step-by-step sum (made up from ``i``).
    code: a first user turn about code (others are skipped). continue: the first words of the record's answers, for
    the target to go on with (a base model's own kind of prompt: text to continue)."""
    users = _turns(rec, "user")
    if kind == "chat":
        return [{"role": "user", "content": users[0]}] if users else None
    if kind == "multi":
        answers = _turns(rec, "assistant")
        if len(users) < 2 or not answers:
            return None
        return [{"role": "user", "content": users[0]}, {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": users[1]}]
    if kind == "code":
        return [{"role": "user", "content": users[0]}] if users and any(w in users[0].lower() for w in _CODE_WORDS) \
            else None
    if kind == "arithmetic":
        return [{"role": "user", "content": _arithmetic(i)}]
    if kind == "continue":
        passage = _passage(rec, CONTINUE_WORDS[i % len(CONTINUE_WORDS)])
        return [{"role": "user", "content": passage}] if passage else None
    passage = _passage(rec, PASSAGE_WORDS[kind])
    if passage is None:
        return None
    task = {"summarize": f"Summarize the following text in two or three sentences.\n\n{passage}",
            "translate": f"Translate the following text into {('French', 'German', 'Spanish')[i % 3]}.\n\n{passage}",
            "passage": f"Read the passage, then answer the question from it.\n\nPassage: {passage}\n\n"
                       f"Question: {users[0] if users else 'What is the passage about?'}"}[kind]
    return [{"role": "user", "content": task}]


ROUND = 20_000  # prompt indices per round: index i asks record i % ROUND of the shuffle (more than ShareGPT holds)


def prompt_kind(kinds: tuple[str, ...], i: int) -> str:
    """The kind of request prompt index ``i`` makes: kinds in turn over the records, shifted by one each round, so
    that each of the first ``len(kinds)`` rounds asks a record for another kind (a new prompt, and a new answer,
    from the same text)."""
    record, round_ = i % ROUND, i // ROUND
    return kinds[(record + round_) % len(kinds)]


def prompts_of(path: Path, kinds: tuple[str, ...], *, limit: int, skip: int, seed: int) -> list[tuple[int, str, list]]:
    """(index, kind, messages) for prompt indices ``skip .. skip + limit``: index i draws record ``i % ROUND`` of
    the seeded shuffle and asks it :func:`prompt_kind` (records a round runs past are skipped)."""
    end = skip + limit
    records, _ = D.read_records(path, limit=None if end > ROUND else end, seed=seed)
    out = []
    for i in range(skip, end):
        if i % ROUND >= len(records):
            continue
        kind = prompt_kind(kinds, i)
        messages = build_prompt(kind, i, records[i % ROUND])
        if messages is not None:
            out.append((i, kind, messages))
    return out


def answered_indices(out: Path) -> set[int]:
    """Prompt indices already answered in ``out``; a last line cut off by an interrupted write is dropped."""
    if not out.is_file():
        return set()
    text = out.read_bytes()
    complete, _, tail = text.rpartition(b"\n")
    if tail.strip():  # written without its newline: the process stopped inside the write
        out.write_bytes(complete + b"\n" if complete else b"")
    return {json.loads(line)["source_index"] for line in complete.split(b"\n") if line.strip()}


def render_prompt(tokenizer, chat: list[dict]) -> str:
    """The text the target answers (a base model: continues; :func:`~medusa_lite.train.data.render_chat`)."""
    return D.render_chat(tokenizer, chat, generation_prompt=True)


@torch.no_grad()
def greedy_batch(target, tokenizer, chats: list[list[dict]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers (token ids, through the first EOS) to the chats' last user turns (a base model:
    its continuations of the rendered text), batched with left padding."""
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    enc = tokenizer(prompts, return_tensors="pt", padding=True,
                    add_special_tokens=not D.has_chat_template(tokenizer)).to(target.device)
    out = target.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                          cache_implementation="static")  # a growing cache re-copies [B, L] K/V every step
    answers = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        answers.append(row[:end])
    return answers


def answer_batch(target, tokenizer, chats: list[list[dict]], max_new_tokens: int) -> list[str]:
    """:func:`greedy_batch` as text. A base model's continuation is cut from the decoded prompt + continuation, so
    that it joins :func:`read_back_prompt` as the tokenizer decodes the whole (a leading space kept)."""
    answers = greedy_batch(target, tokenizer, chats, max_new_tokens)
    if D.has_chat_template(tokenizer):
        return tokenizer.batch_decode(answers, skip_special_tokens=True)
    out = []
    for chat, answer in zip(chats, answers):
        prompt_ids = tokenizer(render_prompt(tokenizer, chat))["input_ids"]
        out.append(tokenizer.decode(prompt_ids + answer, skip_special_tokens=True)[
            len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):])
    return out


def read_back_prompt(tokenizer, chat: list[dict]) -> str:
    """A base model's prompt as its tokenizer reads it back (the text its continuation is joined to)."""
    return tokenizer.decode(tokenizer(render_prompt(tokenizer, chat))["input_ids"], skip_special_tokens=True)


def main(argv=None) -> dict:
    """Answers the prompts not yet in ``--out``; returns ``{answered, answer_tokens, seconds, complete, interrupted}``
    (``KeyboardInterrupt`` stops it after the batches written so far)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from medusa_lite.targets import load_target

    shard, shards = (int(x) for x in args.shard.split("/"))
    target, tokenizer = load_target(**args.load_kwargs())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = prompts_of(D.resolve_data_path(args.prompts), tuple(args.mix), limit=args.num_prompts,
                         skip=args.skip_prompts, seed=args.seed)[shard::shards]
    lengths = {i: len(tokenizer(render_prompt(tokenizer, chat), add_special_tokens=False)["input_ids"])
               for i, _, chat in prompts}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = answered_indices(out)
    todo = sorted(((i, kind, chat) for i, kind, chat in prompts if i not in done and lengths[i] <= args.max_prompt_tokens),
                  key=lambda it: lengths[it[0]])
    print(f"distill: {len(todo)} prompts to answer ({len(done)} already in {out})", flush=True)
    t0, new_tokens, answered, interrupted = time.time(), 0, 0, False
    with out.open("a") as f:
        try:
            for b in range(0, len(todo), args.batch_size):
                batch = todo[b: b + args.batch_size]
                new_tokens += write_answers(f, batch, answer_batch(target, tokenizer, [chat for _, _, chat in batch],
                                                                   args.max_new_tokens), tokenizer)
                answered += len(batch)
                print(f"distill: {b + len(batch)}/{len(todo)} prompts, {new_tokens} answer tokens, "
                      f"{new_tokens / (time.time() - t0):.0f} tok/s", flush=True)
                if args.time_limit_minutes is not None and time.time() - t0 > 60 * args.time_limit_minutes:
                    print(f"distill: time limit of {args.time_limit_minutes} min reached; rerun to continue", flush=True)
                    break
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM under `campaign data`: every batch written so far stays
            interrupted = True
            print(f"distill: interrupted after {answered} prompts; rerun to continue", flush=True)
    return {"answered": answered, "answer_tokens": new_tokens, "seconds": round(time.time() - t0, 1),
            "complete": answered == len(todo), "interrupted": interrupted}


def write_answers(f, batch: list, answers: list[str], tokenizer) -> int:
    """Append one record per (prompt, answer) to ``f`` and flush; returns the answers' tokens. A chat model's record
    is the chat with its answer; a base model's is the text with its continuation and where the continuation starts
    (``prompt_chars``: training learns the continuation only)."""
    tokens = 0
    for (i, kind, chat), answer in zip(batch, answers):
        tokens += len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        if D.has_chat_template(tokenizer):
            record = {"messages": [*chat, {"role": "assistant", "content": answer}]}
        else:
            prompt = read_back_prompt(tokenizer, chat)
            record = {"text": prompt + answer, "prompt_chars": len(prompt)}
        f.write(json.dumps({**record, "source_index": i, "kind": kind}) + "\n")
    f.flush()
    return tokens


if __name__ == "__main__":
    main()
