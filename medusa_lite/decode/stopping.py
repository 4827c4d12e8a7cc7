"""Where a row stops, and why: one rule for ``generate``, its batches and the server.

A row stops at the first token that is a stop token (the generation config's EOS ids unless ``ignore_eos``, and vLLM's
``stop_token_ids``), that completes a stop string in the row's text, or after which a caller's stopping criterion
holds; else when it holds ``max_new`` tokens. Before ``min_new_tokens`` new tokens (vLLM's ``min_tokens``) nothing
stops it: its stop tokens are masked at every tree node (:class:`medusa_lite.sampling.TokenMasks`) and stop strings are
not looked for. The stopping token stays in the row's ids (as transformers returns it); the row's text ends before a
stop string (after it with ``include_stop_str_in_output``) and before a stop token's text (vLLM's rule).

Stop strings are looked for in the decoded text of the new tokens, as vLLM does (``skip_special_tokens`` and
``spaces_between_special_tokens`` as the tokenizer's ``decode`` takes them; ``generate`` keeps special tokens' text, as
transformers' ``StopStringCriteria`` sees them), so a stop string inside one token is found too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from ..sampling import eos_ids

# generation options of vLLM's that are not transformers' fields: extra attributes of the config (as OpenAI's penalties)
STOP_OPTIONS = ("stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens")


@dataclass(frozen=True)
class Finish:
    """Why a row stopped. ``reason``: OpenAI's ``finish_reason`` (``stop`` or ``length``); ``stop_reason``: vLLM's (the
    stop token id or stop string; None at an EOS, a criterion or the length); ``text_end``: where the row's text ends
    (None: all of it)."""

    reason: str
    stop_reason: int | str | None = None
    text_end: int | None = None


@dataclass(frozen=True)
class StopRule:
    """A row's stop conditions (see the module). ``decode``: the tokenizer's ``decode`` options of the row's text."""

    max_new: int
    stop_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()  # the caller's, not EOS (vLLM reports them as the stop reason)
    strings: tuple[str, ...] = ()
    min_new: int = 0
    include_stop_str: bool = False
    criteria: StoppingCriteriaList | None = None
    tokenizer: Any = field(default=None, compare=False)
    decode: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def from_config(cls, config: GenerationConfig, max_new: int, criteria: StoppingCriteriaList | None = None,
                    tokenizer=None) -> "StopRule":
        """The rule of a generation config (its vLLM options: :data:`STOP_OPTIONS`); ``ValueError`` if malformed."""
        stop_token_ids = getattr(config, "stop_token_ids", None) or ()
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {stop_token_ids!r}")
        eos = () if getattr(config, "ignore_eos", False) else eos_ids(config)
        strings = config.stop_strings or ()
        strings = (strings,) if isinstance(strings, str) else tuple(strings)
        if any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {config.stop_strings!r}")
        if strings and tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=..., tokenizer=tok)")
        min_new = config.min_new_tokens or 0
        if not isinstance(min_new, int) or min_new < 0:
            raise ValueError(f"min_new_tokens must be a non-negative integer, got {config.min_new_tokens!r}")
        decode = tuple((name, bool(getattr(config, name))) for name in STOP_OPTIONS[3:]
                       if getattr(config, name, None) is not None)
        return cls(max_new, frozenset(eos) | frozenset(stop_token_ids), frozenset(stop_token_ids), strings, min_new,
                   bool(getattr(config, "include_stop_str_in_output", False)), criteria or None, tokenizer, decode)

    def text(self, ids: list[int]) -> str:
        """The text of new tokens ``ids``, decoded as this row's stop strings are looked for."""
        return self.tokenizer.decode(ids, **dict(self.decode))


class Stopper:
    """A row's tokens and where :class:`StopRule` stops it, token by token (``finish``: why it stopped, once it has)."""

    def __init__(self, prompt: torch.Tensor, rule: StopRule):
        self.rule = rule
        self.ids = prompt.tolist()
        self.prompt_len = len(self.ids)
        self.device = prompt.device
        self.finish: Finish | None = None
        self._searched = 0  # characters of the text already searched for stop strings
        self._text: tuple[int, str] = (0, "")  # (tokens, text) of the last decode

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.rule.max_new - (len(self.ids) - self.prompt_len)

    def text(self) -> str:
        """The row's text so far (all its new tokens, as the rule decodes them)."""
        if self._text[0] != len(self.ids) - self.prompt_len:
            self._text = (len(self.ids) - self.prompt_len, self.rule.text(self.generated))
        return self._text[1]

    def extend(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Append ``tokens`` one by one; return (the tokens kept, whether the row is finished)."""
        kept = []
        for tok in tokens:
            self.ids.append(tok)
            kept.append(tok)
            self.finish = self._check(tok)
            if self.finish is not None:
                return kept, True
        return kept, False

    def _check(self, tok: int) -> Finish | None:
        """Why the row stops at its newest token ``tok``, or None (the order: stop token, stop string, criteria,
        length)."""
        rule = self.rule
        if len(self.ids) - self.prompt_len > rule.min_new:
            if tok in rule.stop_ids:
                return Finish("stop", tok if tok in rule.stop_token_ids else None, self._before_last())
            found = self._stop_string()
            if found is not None:
                return found
            if rule.criteria is not None and bool(rule.criteria(torch.tensor([self.ids], device=self.device),
                                                                None).any()):
                return Finish("stop")
        elif rule.strings:
            self._searched = len(self.text().rstrip("\ufffd"))  # a stop string before min_new tokens does not count
        return Finish("length") if self.remaining <= 0 else None

    def _stop_string(self) -> Finish | None:
        """The earliest stop string in the text the newest token added (searched from where it may start)."""
        if not self.rule.strings:
            return None
        text = self.text()
        hits = [(i, s) for s in self.rule.strings
                if (i := text.find(s, max(0, self._searched - len(s) + 1))) >= 0]
        self._searched = len(text.rstrip("\ufffd"))  # an incomplete character may change with the next token
        if not hits:
            return None
        start, string = min(hits, key=lambda hit: hit[0])
        return Finish("stop", string, start + len(string) if self.rule.include_stop_str else start)

    def _before_last(self) -> int | None:
        """Where the text ends at a stop token: before the token's own text (None: no tokenizer, or it is kept)."""
        if self.rule.tokenizer is None or self.rule.include_stop_str:
            return None
        return len(self.rule.text(self.generated[:-1]))
