"""Logits processing shared by plain sampling and verification.

We build transformers' own warpers (temperature, top-k, top-p, min-p) in the order transformers'
``generate`` applies them, so the distribution the tree is verified against is the distribution plain
sampling draws from. Processors that depend on the generated prefix (repetition penalty, no-repeat
n-grams, ...) are refused: they would need per-node prefixes.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# GenerationConfig fields whose non-default value changes the distribution and that we do not support.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "min_length": 0,
    "min_new_tokens": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "guidance_scale": None, "watermarking_config": None,
    "top_h": None, "assistant_model": None, "prompt_lookup_num_tokens": None,
}


def check_supported(config: GenerationConfig) -> None:
    """Raise ``ValueError`` naming the first generation option medusa_lite cannot honour exactly."""
    for name, default in _UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            raise ValueError(
                f"medusa_lite.generate does not support {name}={value!r}; supported: greedy or sampling "
                "with temperature, top_k, top_p, min_p")


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
