"""The drafter contract: everything that proposes a tree of tokens for the target to verify.

A drafter is an ``nn.Module`` registered by name (:func:`medusa_lite.drafters.register_drafter`) with its
config class. The speculative loop (:func:`medusa_lite.generate.speculative_generate`) knows only this:

- ``hidden_layers``: which of the target's ``hidden_states`` it reads (-1: the final-norm states).
- ``start(ids, hidden)`` after the prompt's forward, ``propose(state, shape, max_depth, sampler)`` each step
  (one :class:`Draft` per batch row), ``commit(state, accepted, hidden, ids)`` after verification (a
  stateful drafter keeps and compacts its own cache there).
- ``forward(hidden, ids)``: teacher-forced logits for training, ``loss(...)`` its training objective,
  ``ranked(...)`` teacher-forced proposals for calibration, ``export_vllm(...)`` its vLLM checkpoint.

Shapes are batch-first with per-row lengths: ``DraftState.ids`` is a list of rows, hidden states are
``[B, ...]``. The frozen target's ``lm_head`` and input embeddings are referenced (:meth:`Drafter.attach`),
never owned: they are neither trained nor saved with the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from ..tree import DynamicTree, TreeBuffers
from ..verify import Proposals


class Draft(NamedTuple):
    """One row's tree for one step: node tokens [N] (root first), its buffers, and which tokens were sampled."""

    tokens: torch.Tensor
    buffers: TreeBuffers
    proposals: Proposals | None = None


@dataclass
class DraftState:
    """What a drafter knows between steps, per batch row.

    ids: per row, every token so far [L_b], ending in the root (the target's next token, not yet in its cache).
    hidden: per hidden layer the drafter reads, [B, H]: the target's state at each row's last accepted position.
    cache: a stateful drafter's own (e.g. its KV cache); None for heads that read the target state only.
    """

    ids: list[torch.Tensor]
    hidden: tuple[torch.Tensor, ...]
    cache: object = None

    @classmethod
    def single(cls, ids: torch.Tensor, *hidden: torch.Tensor) -> "DraftState":
        """One row: ids [L] ending in the root, per hidden layer the state [H] at the last accepted position
        (replays and probes that draft from known positions, without a loop)."""
        return cls([ids], tuple(h[None] for h in hidden))


TreeShape = TreeBuffers | DynamicTree  # a static tree's buffers, or the budget of a tree grown per step


class Drafter(nn.Module):
    """Base of every registered drafter; see the module docstring for the contract."""

    name: ClassVar[str]
    hidden_layers: ClassVar[tuple[int, ...]] = (-1,)
    dynamic_trees: ClassVar[bool] = False  # can grow its own tree each step (EAGLE-2 expansion)
    vllm_refusal: ClassVar[str | None] = None  # why vLLM cannot run it (None: export_vllm is implemented)

    def __init__(self, config):
        super().__init__()
        self.config = config

    # ------------------------------------------------------------------ the frozen target
    def attach(self, target) -> None:
        """Reference the frozen target's output projection and input embeddings (not submodules: not saved)."""
        self.__dict__["_target_io"] = (target.get_output_embeddings(), target.get_input_embeddings())

    @property
    def target_lm_head(self) -> nn.Module:
        return self.__dict__["_target_io"][0]

    @property
    def target_embed(self) -> nn.Module:
        return self.__dict__["_target_io"][1]

    # ------------------------------------------------------------------ decoding
    def start(self, ids: list[torch.Tensor], hidden: tuple[torch.Tensor, ...]) -> DraftState:
        """After the prompt's forward. ids: per row [L_b] ending in the root; hidden: per hidden layer [B, L, H]."""
        last = torch.tensor([row.numel() - 2 for row in ids], device=hidden[0].device)  # the prompt's last position
        rows = torch.arange(len(ids), device=hidden[0].device)
        return DraftState(list(ids), tuple(h[rows, last] for h in hidden))

    def propose(self, state: DraftState, shape: TreeShape, max_depth: int, sampler=None) -> list[Draft]:
        """One :class:`Draft` per row: a static tree's tokens (``shape``: its buffers, capped at ``max_depth``
        by the caller) or a tree grown within the budget ``shape`` (a :class:`DynamicTree`), no deeper
        than ``max_depth``. With a ``sampler`` tokens are drawn from the drafter's distribution."""
        return [self.draft_row(tuple(h[b] for h in state.hidden), ids, shape, max_depth, sampler)
                for b, ids in enumerate(state.ids)]

    def draft_row(self, hidden: tuple[torch.Tensor, ...], ids: torch.Tensor, shape: TreeShape, max_depth: int,
                  sampler=None) -> Draft:
        raise NotImplementedError

    def commit(self, state: DraftState, accepted: list[torch.Tensor], hidden: tuple[torch.Tensor, ...],
               ids: list[torch.Tensor]) -> None:
        """After verification. accepted: per row the accepted node indices [a_b + 1] (root first); hidden: per
        hidden layer the verify forward's [B, N, H]; ids: per row every token so far, ending in the new root."""
        rows = torch.arange(len(accepted), device=hidden[0].device)
        last = torch.stack([nodes[-1] for nodes in accepted]).to(hidden[0].device)
        state.hidden = tuple(h[rows, last] for h in hidden)
        state.ids = list(ids)

    # ------------------------------------------------------------------ training, calibration, export
    def ranked(self, hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        """Teacher-forced proposals along a known sequence: hidden [T, H], ids [T] -> [K, T, topk] token ids."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
             loss: str = "kl", decay: float = 0.8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def export_vllm(cls, config, state: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
        """(vLLM ``config.json`` dict, tensors) for a saved drafter; ValueError naming why where vLLM cannot."""
        raise ValueError(f"vLLM cannot run {cls.name!r} drafters: {cls.vllm_refusal or 'no export written'}")
