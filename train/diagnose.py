"""medusa-lite diagnose: where a drafter's proposals go wrong, position by position.

    medusa-lite diagnose --heads DIR --per-task 5 --max-new-tokens 256 --heldout runs/campaign/eval.jsonl

Two kinds of text are scored the same way, teacher-forced (one target forward per sequence, the drafter's
top-1 at every answer position against the target's own greedy choice, on the path where every earlier
proposal was right):

* the target's greedy continuations of Spec-Bench questions (the benchmark's own first ``--per-task`` per task:
  measured, never trained on), grouped by task;
* held-out documents of a chat JSONL (``--heldout``, e.g. self-distilled answers to prompts no training run drew),
  grouped by their ``kind``.

Each group is broken down by the context length at the predicted token, by the position in the answer, and by
whether the token is *copyable*: the two tokens before it followed by it occur earlier in the sequence (what
prompt lookup would find). The report (JSON + Markdown) says which of these the gap between held-out and
benchmark accuracy follows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_lite.settings import SettingsParser, TargetOptions, option
from medusa_lite.specbench import DEFAULT_QUESTIONS, load_questions

CONTEXT_BUCKETS = (256, 512, 1024, 2048)   # upper bounds of the context length at the predicted token
ANSWER_BUCKETS = (16, 64, 128, 256, 512)   # upper bounds of the position in the answer


@dataclass
class DiagnoseSettings(TargetOptions):
    """``medusa-lite diagnose`` settings: these defaults < ``--config FILE`` < flags."""

    heads: str | None = option(None, "heads directory, bundled drafter name or Hub repo id"
                               " (default: the bundled default)")
    questions: str = option(str(DEFAULT_QUESTIONS), "Spec-Bench question.jsonl")
    per_task: int = option(5, "Spec-Bench questions per task (the first ones: the benchmark's own)")
    max_new_tokens: int = option(256, "length of the target's continuations")
    batch_size: int = option(10, "continuations generated per batch")
    heldout: str | None = option(None, "chat JSONL of held-out documents (self-distilled), scored on the last "
                                       "assistant turn and grouped by their 'kind'")
    heldout_limit: int = option(200, "held-out documents scored")
    continuations: str | None = option(None, "JSON cache of the Spec-Bench continuations (reused when it matches)")
    threads: int | None = option(None, "torch.set_num_threads")
    out: str = option("runs/diagnose/report", "report path stem (.json and .md are written)")


# ---------------------------------------------------------------------------------------------- math
def copyable(seq: list[int], ngram: int = 2) -> list[bool]:
    """Per index j of ``seq``: do the ``ngram`` tokens before j followed by seq[j] occur earlier in seq[:j]?"""
    seen: set[tuple[int, ...]] = set()
    out = []
    for j in range(len(seq)):
        key = tuple(seq[max(j - ngram, 0): j + 1])
        out.append(j >= ngram and key in seen)
        if j >= ngram:
            seen.add(key)
    return out


def position_hits(ranked: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """ranked [K, T] top-1 proposals (head k at t proposes the token for t + 2 + k); choice [T] the target's token
    for t + 1. Returns hits [K, T] float with NaN where the answer lies beyond T."""
    num_heads, length = ranked.shape
    hits = torch.full((num_heads, length), float("nan"))
    for k in range(num_heads):
        n = length - 1 - k
        if n > 0:
            hits[k, :n] = (ranked[k, :n] == choice[1 + k:1 + k + n].to(ranked.device)).float().cpu()
    return hits


def bucket(value: int, bounds: tuple[int, ...]) -> str:
    """A label that sorts in numeric order: '0000-0255', ..., '2048+'."""
    lo = 0
    for b in bounds:
        if value < b:
            return f"{lo:04d}-{b - 1:04d}"
        lo = b
    return f"{bounds[-1]:04d}+"


class Tally:
    """Sums of hits per head and positions, by (group, facet, value)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.sums: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros(2, num_heads, dtype=torch.float64))

    def add(self, group: str, hits: torch.Tensor, labels: dict[str, list[str]]) -> None:
        """hits [K, T] (NaN: not scored); labels: facet -> a value per position t."""
        valid = ~hits.isnan()
        for facet, values in [("all", ["all"] * hits.shape[1]), *labels.items()]:
            for value in set(values):
                mask = torch.tensor([v == value for v in values]) & valid  # [K, T]
                entry = self.sums[(group, facet, value)]
                entry[0] += torch.where(mask, hits, 0).sum(dim=1).double()
                entry[1] += mask.sum(dim=1).double()

    def rows(self) -> list[dict]:
        out = []
        for (group, facet, value), (hit, total) in sorted(self.sums.items()):
            out.append({"group": group, "facet": facet, "value": value, "positions": int(total[0]),
                        "top1": [round(float(h / t), 3) if t else None for h, t in zip(hit, total)]})
        return out


# ---------------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def score_sequence(model, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, dict[str, list[str]]]:
    """Teacher-forced top-1 of ``model``'s drafter over ``ids[start:]`` (the answer): hits [K, T] and the facets
    of every position (:meth:`Tally.add`)."""
    from medusa_lite.drafters import drafter_features

    out = model.base_model(input_ids=ids[None], output_hidden_states=True, return_dict=True, use_cache=False)
    first = start - 1
    hidden = drafter_features(out.hidden_states, model.drafter.hidden_layers)[0]       # [L, F]
    choice = out.logits[0, first:].argmax(dim=-1)                                      # [T]
    ranked = model.drafter.ranked(hidden, ids, 1)[:, first:, 0]                        # [K, T]
    hits = position_hits(ranked, choice)                                               # [K, T]
    seq = ids.tolist()
    copy = copyable(seq)
    # head 1 at t predicts index first + t + 2; its facets describe that token
    index = [first + t + 2 for t in range(hits.shape[1])]
    vocab = getattr(model.drafter, "draft_ids", None)
    proposable = set(vocab.tolist()) if vocab is not None else None
    labels = {"context": [bucket(j, CONTEXT_BUCKETS) for j in index],
              "answer_position": [bucket(j - start, ANSWER_BUCKETS) for j in index],
              "copyable": [str(copy[j]) if j < len(seq) else "n/a" for j in index],
              # can the drafter propose the token at all (its draft vocabulary)? its misses elsewhere are its own
              "in_draft_vocab": [str(proposable is None or int(choice[t + 1]) in proposable) if t + 1 < len(choice)
                                 else "n/a" for t in range(hits.shape[1])]}
    return hits, labels


def greedy_continuations(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int):
    """[(ids [L], prompt length)]: the target's greedy answers (batched, left padding, cut after EOS)."""
    from medusa_lite.train.distill_data import greedy_batch

    out = []
    for b in range(0, len(prompts), batch_size):
        chats = prompts[b: b + batch_size]
        for chat, answer in zip(chats, greedy_batch(model.base_model, tokenizer, chats, max_new_tokens)):
            prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"][0]
            out.append((torch.cat([prompt, torch.tensor(answer)]), prompt.numel()))
    return out


def specbench_sequences(model, tokenizer, args) -> list[tuple[str, torch.Tensor, int]]:
    questions = load_questions(args.questions, limit=args.per_task)
    key = {"question_ids": [q.question_id for q in questions], "max_new_tokens": args.max_new_tokens,
           "target": args.target}
    # a revision or a dtype other than fp32 joins the key; fp32 keeps the key of the committed caches
    key.update({name: value for name, value in (("revision", args.revision), ("dtype", args.dtype))
                if value not in (None, "fp32")})
    cache = Path(args.continuations) if args.continuations else None
    if cache is not None and cache.is_file() and json.loads(cache.read_text())["key"] == key:
        saved = json.loads(cache.read_text())["sequences"]
    else:
        chats = [[{"role": "user", "content": q.prompt}] for q in questions]
        seqs = greedy_continuations(model, tokenizer, chats, args.max_new_tokens, args.batch_size)
        saved = [(ids.tolist(), start) for ids, start in seqs]
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"key": key, "sequences": saved}) + "\n")
    return [(f"specbench/{q.task}", torch.tensor(ids), start) for q, (ids, start) in zip(questions, saved)]


def heldout_sequences(tokenizer, path: str, limit: int) -> list[tuple[str, torch.Tensor, int]]:
    """Chat JSONL records -> (group, ids, start of the last assistant turn)."""
    from medusa_lite.train.data import read_text

    out = []
    for line in read_text(Path(path)).splitlines()[:limit]:
        rec = json.loads(line)
        messages = rec["messages"]
        ids = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)["input_ids"][0]
        start = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"].shape[1]
        if ids.numel() > start + 2:
            out.append((f"heldout/{rec.get('kind', 'chat')}", ids, start))
    return out


def markdown(rows: list[dict], num_heads: int) -> str:
    heads = " | ".join(f"pos {k + 1}" for k in range(num_heads))
    lines = [f"| group | facet | value | positions | {heads} |", "|---|---|---|---|" + "---|" * num_heads]
    for r in rows:
        cells = " | ".join("-" if a is None else f"{a:.3f}" for a in r["top1"])
        lines.append(f"| {r['group']} | {r['facet']} | {r['value']} | {r['positions']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    # parse
    args = SettingsParser(DiagnoseSettings, prog="medusa-lite diagnose", description=__doc__,
                          kind="diagnose").parse(argv)[0].resolve()  # the cache key names the dtype that ran
    if args.threads:
        torch.set_num_threads(args.threads)
    from medusa_lite.targets import load_model

    # build
    model, tokenizer = load_model(heads=args.heads, **args.load_kwargs())
    tokenizer.padding_side = "left"
    sequences = specbench_sequences(model, tokenizer, args)
    if args.heldout:
        sequences += heldout_sequences(tokenizer, args.heldout, args.heldout_limit)

    # run
    tally = Tally(model.config.num_heads)
    for group, ids, start in sequences:
        hits, labels = score_sequence(model, ids.to(model.device), start)
        for name in (group, group.split("/")[0] + "/all"):  # the group and its source's total
            tally.add(name, hits, labels)

    # save
    rows = tally.rows()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"heads": str(model.heads_dir), "settings": vars(args), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, model.config.num_heads))
    print(markdown([r for r in rows if r["facet"] in ("all", "copyable")], model.config.num_heads))
    return report


if __name__ == "__main__":
    main()
