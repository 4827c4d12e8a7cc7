"""The acceptance table shipped with the heads (``acceptance.json``): every candidate tree's tokens per step by
context bucket, for greedy decoding and for sampling. Hardware-independent; measured once, offline, by
``medusa-lite calibrate`` (:mod:`medusa_lite.calibrate`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

ACCEPTANCE_NAME = "acceptance.json"
ACCEPTANCE_FORMAT = "medusa_lite.acceptance/1"
MIN_BUCKET_STEPS = 20               # fewer replayed steps in a bucket: use the candidate's pooled figures


@dataclass
class Candidate:
    """One candidate tree's hardware-independent figures, per context bucket."""

    tree: list | dict                  # the tree in JSON form ([] = the root alone)
    tokens_per_step: list[float]       # accepted + bonus per step, per bucket
    nodes: list[float]                 # tree tokens verified per step (root included), per bucket
    steps: list[int]                   # steps measured per bucket (0: no data; pooled figures used)

    def __post_init__(self) -> None:
        n = len(self.steps)
        if not (len(self.tokens_per_step) == len(self.nodes) == n) or n == 0:
            raise ValueError(f"candidate {self.tree!r}: per-bucket lists of different lengths")
        for name in ("tokens_per_step", "nodes"):
            values = getattr(self, name)
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 1.0 for v in values):
                raise ValueError(f"candidate {self.tree!r}: {name} must be finite numbers >= 1, got {values}")

    def in_bucket(self, bucket: int) -> tuple[float, float]:
        """(tokens per step, nodes) in ``bucket``; the step-weighted pool over buckets where it has too few steps."""
        if self.steps[bucket] >= MIN_BUCKET_STEPS:
            return self.tokens_per_step[bucket], self.nodes[bucket]
        total = sum(self.steps)
        if total == 0:
            return sum(self.tokens_per_step) / len(self.steps), sum(self.nodes) / len(self.steps)
        tokens = sum(t * s for t, s in zip(self.tokens_per_step, self.steps)) / total
        nodes = sum(n * s for n, s in zip(self.nodes, self.steps)) / total
        return tokens, nodes


@dataclass
class AcceptanceTable:
    """``acceptance.json``: every candidate tree's tokens per step by context bucket, for greedy decoding and
    for sampling (measured at ``sample_temperature``), with where the figures came from."""

    buckets: list[int]
    greedy: list[Candidate]
    sample: list[Candidate] = field(default_factory=list)
    sample_temperature: float | None = None
    data: dict = field(default_factory=dict)   # provenance: prompts, tokens, date, heads

    def __post_init__(self) -> None:
        if not self.buckets or self.buckets[0] != 0 or sorted(set(self.buckets)) != list(self.buckets):
            raise ValueError(f"acceptance buckets must start at 0 and increase, got {self.buckets}")
        for c in self.greedy + self.sample:
            if len(c.steps) != len(self.buckets):
                raise ValueError(f"candidate {c.tree!r} has {len(c.steps)} buckets, the table {len(self.buckets)}")

    def candidates(self, sample: bool) -> list[Candidate]:
        """The candidates for sampling (greedy ones if the table has none) or for greedy decoding."""
        return (self.sample or self.greedy) if sample else self.greedy

    def to_dict(self) -> dict:
        return {"format": ACCEPTANCE_FORMAT, "buckets": list(self.buckets),
                "greedy": [asdict(c) for c in self.greedy], "sample": [asdict(c) for c in self.sample],
                "sample_temperature": self.sample_temperature, "data": self.data}

    @classmethod
    def from_dict(cls, data: dict, source: str = "acceptance table") -> "AcceptanceTable":
        if not isinstance(data, dict) or data.get("format") != ACCEPTANCE_FORMAT:
            raise ValueError(f"{source}: not a {ACCEPTANCE_FORMAT} file")
        try:
            return cls(buckets=list(data["buckets"]), greedy=[Candidate(**c) for c in data["greedy"]],
                       sample=[Candidate(**c) for c in data.get("sample", [])],
                       sample_temperature=data.get("sample_temperature"), data=dict(data.get("data", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: malformed acceptance table: {e}") from e

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / ACCEPTANCE_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "AcceptanceTable | None":
        """The table in ``directory``, or None when it has none."""
        path = Path(directory) / ACCEPTANCE_NAME
        if not path.is_file():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()), str(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
