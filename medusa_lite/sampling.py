"""Logits processing shared by plain sampling and verification.

We build transformers' own warpers (temperature, top-k, top-p, min-p) in the order transformers'
``generate`` applies them, so the distribution the tree is verified against is the distribution plain
sampling draws from. The penalties that depend on the prefix (transformers' / vLLM's repetition penalty, OpenAI's
presence and frequency penalties: :class:`Penalties`) are applied at every tree node from that node's own prefix
(:func:`penalized_logits`), exactly as plain decoding applies them at the step that reaches the node. A bias on
single tokens (transformers' ``sequence_bias`` of one-token sequences, OpenAI's ``logit_bias``) is added first, as
both apply it; other prefix-dependent processors (no-repeat n-grams, biases on longer sequences, ...) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# options of OpenAI's and vLLM's that are not transformers' fields: extra attributes of the generation config
SAMPLING_OPTIONS = ("presence_penalty", "frequency_penalty", "allowed_token_ids")

# GenerationConfig fields whose non-default value changes the distribution and that we do not support.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None,
    "no_repeat_ngram_size": 0, "force_words_ids": None, "min_length": 0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "guidance_scale": None, "watermarking_config": None,
    "top_h": None, "assistant_model": None, "prompt_lookup_num_tokens": None,
}


def check_supported(config: GenerationConfig, vocab: int | None = None) -> None:
    """Raise ``ValueError`` naming the first generation option medusa_lite cannot honour exactly (``vocab``: the
    target's output vocabulary, which a biased token must be in)."""
    for name, default in _UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            raise ValueError(
                f"medusa_lite.generate does not support {name}={value!r}; supported: greedy or sampling "
                "with temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, "
                "sequence_bias (single tokens), bad_words_ids, min_new_tokens, allowed_token_ids")
    penalties = Penalties.from_config(config)  # ValueError for a penalty out of range
    outside = [token for token, _ in penalties.bias if vocab is not None and token >= vocab]
    if outside:
        raise ValueError(f"sequence_bias: token {outside[0]} is outside the vocabulary ({vocab} tokens)")
    masks = TokenMasks.from_config(config, ())  # ValueError for a malformed list
    named = [(name, t) for name, ids in (("allowed_token_ids", masks.allowed or ()),
                                         ("bad_words_ids", [t for w in masks.bad_words for t in w])) for t in ids]
    outside = [(name, t) for name, t in named if vocab is not None and t >= vocab]
    if outside:
        raise ValueError(f"{outside[0][0]}: token {outside[0][1]} is outside the vocabulary ({vocab} tokens)")


@dataclass(frozen=True)
class Penalties:
    """Penalties on tokens the prefix already holds, applied to the raw logits before the warpers (transformers'
    and vLLM's order). ``repetition``: transformers' ``repetition_penalty`` over prompt and output tokens (a positive
    logit divided by it, a negative one multiplied). ``presence`` / ``frequency``: OpenAI's, over output tokens only
    (minus ``presence`` for a token present, minus ``frequency`` times its count), as vLLM applies them.
    ``bias``: (token id, value) pairs added to the logits before the penalties (transformers' ``sequence_bias`` of
    one-token sequences, OpenAI's ``logit_bias``; both add it first)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.repetition > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition!r}")
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (OpenAI's range), got {value!r}")

    @classmethod
    def from_config(cls, config: GenerationConfig) -> "Penalties":
        """The penalties a generation config asks for (``presence_penalty`` / ``frequency_penalty``: extra attributes)."""
        def value(name: str, default: float) -> float:
            v = getattr(config, name, None)
            return default if v is None else float(v)
        return cls(value("repetition_penalty", 1.0), value("presence_penalty", 0.0), value("frequency_penalty", 0.0),
                   token_bias(getattr(config, "sequence_bias", None)))

    @property
    def active(self) -> bool:
        return self != Penalties()

    @property
    def prefix_dependent(self) -> bool:
        """Whether any penalty depends on the prefix (the bias does not)."""
        return (self.repetition, self.presence, self.frequency) != (1.0, 0.0, 0.0)


def token_bias(sequence_bias) -> tuple[tuple[int, float], ...]:
    """transformers' ``sequence_bias`` ({(ids...): bias} or [[ids, bias], ...]) as sorted (token id, bias) pairs;
    ``ValueError`` for a sequence longer than one token (its bias would depend on the tokens before it)."""
    if sequence_bias is None:
        return ()
    items = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
    bias: dict[int, float] = {}
    for ids, value in items:
        ids = (ids,) if isinstance(ids, int) else tuple(ids)
        if len(ids) != 1 or not isinstance(ids[0], int) or ids[0] < 0:
            raise ValueError(f"sequence_bias: only single tokens (one non-negative id) are supported, got {ids!r}")
        bias[ids[0]] = float(value)
    return tuple(sorted(bias.items()))


def penalized_logits(logits: torch.Tensor, penalties: Penalties, prompt_seen: torch.Tensor, output_counts: torch.Tensor,
                     tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Each tree node's logits after the token bias and the penalties of that node's own prefix.

    logits: [N, V] raw target logits at the nodes; prompt_seen: [V] bool, tokens of the prompt;
    output_counts: [V] float32, each token's count in the output so far, the root included (it is emitted already);
    tokens: [N] node tokens; ancestors: [N, N] bool, node i's path (j is i or an ancestor of i), root included.
    Node i's prefix is the prompt, the output and the tokens of its path below the root. -> [N, V] float32.
    """
    scores = logits.float().clone()  # [N, V]
    if penalties.bias:
        ids = torch.tensor([i for i, _ in penalties.bias], device=logits.device)  # [K], ids < V (check_supported)
        scores[:, ids] += torch.tensor([v for _, v in penalties.bias], device=logits.device)  # [N, K]
    if not penalties.prefix_dependent:
        return scores
    # only the columns of tokens the prefixes hold change: work on those ([N, C], C << V)
    cols = torch.unique(torch.cat([(prompt_seen | (output_counts > 0)).nonzero().flatten(), tokens]))  # [C] sorted
    path = ancestors.float().clone()  # [N, N]
    path[:, 0] = 0.0  # the root is counted in the output already
    counts = output_counts[cols][None].repeat(logits.shape[0], 1)  # [N, C]
    counts.index_add_(1, torch.searchsorted(cols, tokens), path)  # + each node's path tokens
    sub = scores[:, cols]  # [N, C]
    if penalties.repetition != 1.0:
        seen = prompt_seen[cols][None] | (counts > 0)  # [N, C]
        scaled = torch.where(sub < 0, sub * penalties.repetition, sub / penalties.repetition)
        sub = torch.where(seen, scaled, sub)
    if penalties.frequency:
        sub = sub - penalties.frequency * counts
    if penalties.presence:
        sub = sub - penalties.presence * (counts > 0).float()
    scores[:, cols] = sub
    return scores


def eos_ids(config: GenerationConfig) -> tuple[int, ...]:
    """The config's EOS ids (``eos_token_id``: None, an id or a list of ids): the one place they are read."""
    eos = config.eos_token_id
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _token_ids(value, name: str) -> tuple[int, ...]:
    ids = tuple(value)
    if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise ValueError(f"{name}: a non-empty list of non-negative token ids, got {value!r}")
    return ids


@dataclass(frozen=True)
class TokenMasks:
    """Tokens a tree node may not choose, decided from that node's own prefix exactly as the logits processors of
    plain decoding decide them at the step that reaches the node: every token outside ``allowed`` (vLLM's
    ``allowed_token_ids``); the last token of a ``bad_words`` sequence whose other tokens end the prefix (transformers'
    ``bad_words_ids``, ``NoBadWordsLogitsProcessor``, which drops a bad word that is one EOS id); the ``stop_ids``
    while the prefix holds fewer than ``min_new`` new tokens (transformers' ``min_new_tokens``, vLLM's
    ``min_tokens``, which masks vLLM's ``stop_token_ids`` too)."""

    allowed: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_new: int = 0
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: GenerationConfig, stop_ids) -> "TokenMasks":
        """The masks of a generation config (``allowed_token_ids``: an extra attribute); ``stop_ids``: the row's stop
        tokens (:class:`medusa_lite.decode.stopping.StopRule`). ``ValueError`` for a malformed list."""
        allowed = getattr(config, "allowed_token_ids", None)
        allowed = None if allowed is None else tuple(sorted(set(_token_ids(allowed, "allowed_token_ids"))))
        words = tuple(_token_ids(w, "bad_words_ids") for w in config.bad_words_ids or ())
        words = tuple(w for w in words if not (len(w) == 1 and w[0] in eos_ids(config)))
        return cls(allowed, words, config.min_new_tokens or 0, tuple(sorted(stop_ids)))

    @property
    def active(self) -> bool:
        return self.allowed is not None or bool(self.bad_words) or (self.min_new > 0 and bool(self.stop_ids))


def masked_logits(scores: torch.Tensor, masks: TokenMasks, history: list[int], new_tokens: int, tokens: torch.Tensor,
                  ancestors: torch.Tensor) -> torch.Tensor:
    """Each tree node's scores [N, V] float32 with the tokens :class:`TokenMasks` forbids after that node's own prefix
    set to -inf (in place). history: the prompt and the output so far, ending in the root (emitted already);
    new_tokens: the output's count, the root included; tokens: [N] node tokens; ancestors: [N, N] bool, node i's path
    (j is i or an ancestor of i), root included. Node i's prefix is the history and the tokens of its path below the
    root (parents precede their children, so the path in index order is the path from the root)."""
    vocab, device = scores.shape[-1], scores.device
    if masks.allowed is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[torch.tensor(masks.allowed, device=device)] = True
        scores[:, ~keep] = float("-inf")
    if masks.min_new and masks.stop_ids:
        early = (new_tokens + ancestors.sum(dim=1) - 1 < masks.min_new).nonzero().flatten()  # [n] nodes
        stops = torch.tensor([t for t in masks.stop_ids if t < vocab], dtype=torch.long, device=device)
        scores[early[:, None], stops[None]] = float("-inf")
    single = [w[0] for w in masks.bad_words if len(w) == 1]
    if single:
        scores[:, torch.tensor(single, device=device)] = float("-inf")
    longer = [w for w in masks.bad_words if len(w) > 1]
    if longer:
        tail = max(len(w) for w in longer) - 1
        below_root = tokens.tolist()
        for i, row in enumerate(ancestors.tolist()):
            prefix = history[-tail:] + [below_root[j] for j in range(1, len(row)) if row[j]]
            for word in longer:
                if prefix[len(prefix) - len(word) + 1:] == list(word[:-1]):
                    scores[i, word[-1]] = float("-inf")
    return scores


def build_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The sampling warpers of ``config``, in transformers' order (temperature, top-k, top-p, min-p)."""
    warpers = LogitsProcessorList()
    if not config.do_sample:
        return warpers
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if getattr(config, "min_p", None) is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return warpers


def target_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """logits: [N, V] raw target logits -> [N, V] float32 probabilities after the warpers."""
    scores = logits.float()
    dummy_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
    scores = warpers(dummy_ids, scores)
    return torch.softmax(scores, dim=-1)


class DraftSampler:
    """Sampling mode's drafting: each head row's tokens are *drawn* from the head's distribution, processed
    by the same warpers as the target's, instead of taken as its top ranks.

    Verified with :func:`medusa_lite.verify.sample_walk`, a drawn token is accepted with probability
    min(1, p/q) instead of p: where the target is unsure (T = 1), drawing from a head that matches its
    distribution accepts far more often than proposing the head's most likely tokens.
    """

    def __init__(self, warpers: LogitsProcessorList, generator: torch.Generator | None = None):
        self.warpers, self.generator = warpers, generator

    def __call__(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [M, V'] head logits -> (q [M, V'] float32 proposal, drawn [M, k] indices into V').

        ``k`` draws per row without replacement (``torch.multinomial`` draws them one after another,
        each proportional to the remaining mass). A floor of 1e-9 keeps every token drawable so rows
        with fewer than ``k`` tokens left after top-k / top-p still yield k draws; q includes it.
        """
        q = target_probs(logits, self.warpers) + 1e-9  # [M, V']
        q = q / q.sum(dim=-1, keepdim=True)
        return q, torch.multinomial(q, k, replacement=False, generator=self.generator)


class TargetRows:
    """The processed target distribution at each node of a verified tree (``logits`` [N, V], through ``warpers``),
    float64, computed only for the nodes a walk asks for: ``rows(node) -> [V]``."""

    def __init__(self, logits: torch.Tensor, warpers):
        self.logits, self.warpers = logits, warpers

    def __call__(self, node: int) -> torch.Tensor:
        return target_probs(self.logits[node: node + 1], self.warpers)[0].double()
