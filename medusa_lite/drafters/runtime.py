"""What decoding needs of a drafter, its runtime contract: the decoding loop (:mod:`medusa_lite.decode`) and the
fit's probe (:mod:`medusa_lite.fit`) use nothing else of a drafter. Training loss, calibration ranking and
public-format import/export are other concerns of the registered drafters (:class:`~.base.Drafter`), outside it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .base import Draft, DraftState, TreeShape


@runtime_checkable
class DraftRuntime(Protocol):
    """Start after the prompt's forward, propose a draft per row, commit what verification accepted; rows are
    batched in one :class:`~.base.DraftState`."""

    hidden_layers: tuple[int, ...]  # the target layers whose hidden states feed start and commit

    def start(self, ids: list[torch.Tensor], hidden: torch.Tensor) -> DraftState: ...

    def propose(self, state: DraftState, shape: TreeShape, max_depth: int | list[int],
                sampler=None) -> list[Draft]: ...

    def commit(self, state: DraftState, accepted: list[torch.Tensor], hidden: torch.Tensor,
               ids: list[torch.Tensor]) -> None: ...

    def require_dynamic_trees(self) -> None: ...  # ValueError unless it can grow its own tree each step


RUNTIME = ("hidden_layers", "start", "propose", "commit", "require_dynamic_trees")  # DraftRuntime's members
