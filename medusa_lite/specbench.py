"""Spec-Bench questions (github.com/hemingkx/Spec-Bench): the six tasks and a loader, which also reads the prompts
``medusa-lite calibrate`` measures acceptance on (rows that name their own task). Pure data, no model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# task -> inclusive question_id range, as in Spec-Bench's own evaluation scripts
TASKS: dict[str, tuple[int, int]] = {
    "mt_bench": (81, 160),
    "translation": (161, 240),
    "summarization": (241, 320),
    "qa": (321, 400),
    "math_reasoning": (401, 480),
    "rag": (481, 560),
}

# shipped with the package (provenance and licence: data/specbench/README.md, data/calibration/README.md)
DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "data" / "specbench" / "question.jsonl"
CALIBRATION_PROMPTS = Path(__file__).resolve().parent / "data" / "calibration" / "prompts.jsonl"


@dataclass
class Question:
    question_id: int
    task: str
    prompt: str  # the first turn (multi-turn MT-bench questions are benchmarked on their first turn only)


def task_of(question_id: int) -> str | None:
    """The Spec-Bench task of a question id, or None outside the six ranges."""
    for task, (lo, hi) in TASKS.items():
        if lo <= question_id <= hi:
            return task
    return None


def load_questions(path: str | Path = DEFAULT_QUESTIONS, *, limit: int | None = None, tasks=None,
                   from_end: bool = False) -> list[Question]:
    """Read ``question.jsonl``; keep ``limit`` questions per task (the first ones, or the last with ``from_end``).

    A row is ``{"question_id", "turns"}`` (Spec-Bench: the task is the id's range) or names its own ``"task"``
    (the calibration prompts). ``tasks``: names to keep (default all: Spec-Bench's six, in its order, then the
    others in the order they first appear). Questions are returned grouped by task, in id order.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not path.is_file():
        raise FileNotFoundError(f"questions not found at {path}")
    by_task: dict[str, list[Question]] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        task = row.get("task") or task_of(int(row["question_id"]))
        if task is None:
            continue
        turns = row.get("turns") or []
        if not turns:
            raise ValueError(f"{path}:{line_no}: question {row['question_id']} has no turns")
        by_task.setdefault(task, []).append(Question(int(row["question_id"]), task, str(turns[0])))
    known = [t for t in TASKS if t in by_task] + [t for t in by_task if t not in TASKS]
    wanted = list(tasks) if tasks else known
    unknown = sorted(set(wanted) - set(known) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {known or list(TASKS)}")
    out: list[Question] = []
    for task in wanted:
        qs = sorted(by_task.get(task, []), key=lambda q: q.question_id)
        if limit is not None:
            qs = qs[-limit:] if from_end else qs[:limit]
        out.extend(qs)
    return out


def chat_prompt(tokenizer, text: str):
    """[1, L] input ids of a one-turn chat with the tokenizer's chat template, generation prompt added; for a model
    without a template (a base model) the text itself, which the model continues (the form its self-distilled
    training data takes: ``distill-data`` on a base model)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text, return_tensors="pt")["input_ids"]
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
