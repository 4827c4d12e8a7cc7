"""Many rows in one cache: rows joining, selected and leaving, each row's accepted nodes kept, and the holes that
leaves compacted. ``valid`` [B, S] marks the slots each row attends to."""

from __future__ import annotations

import torch
from transformers import DynamicCache

def _pad_slots(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, n + S, D], n zero slots in front."""
    return torch.nn.functional.pad(x, (0, 0, n, 0)) if n else x


def join_rows(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor) -> torch.Tensor:
    """Append ``other``'s rows to ``cache`` (in place): the shorter side is left-padded with holes.
    valid: [B, S], other_valid: [B', S'] -> [B + B', max(S, S')]."""
    s, t = valid.shape[1], other_valid.shape[1]
    length = max(s, t)
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([_pad_slots(mine.keys, length - s), _pad_slots(theirs.keys, length - t)])
        mine.values = torch.cat([_pad_slots(mine.values, length - s), _pad_slots(theirs.values, length - t)])
    pad = torch.nn.functional.pad
    return torch.cat([pad(valid, (length - s, 0)), pad(other_valid, (length - t, 0))])


def select_rows(cache: DynamicCache, valid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep only ``rows`` ([B'] long) of the cache (in place); returns their valid mask [B', S]."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
    return valid.index_select(0, rows)


def keep_accepted_rows(cache: DynamicCache, prefix_len: int, accepted: list[torch.Tensor]) -> torch.Tensor:
    """Batched :func:`keep_accepted`: row b keeps slots ``[0, prefix_len)`` and its accepted nodes, moved to the
    front of the step's block; the block is cut to the longest row's A nodes.

    accepted: per row [a_b] long node indices, increasing (root first). Returns [B, A] bool: which of the A new
    slots each row holds (the others are holes)."""
    lengths = [int(a.numel()) for a in accepted]
    width = max(lengths)
    device = cache.layers[0].keys.device
    if any(int(a[-1]) != n - 1 for a, n in zip(accepted, lengths)):  # some row accepted a non-first branch
        index = torch.stack([torch.nn.functional.pad(a, (0, width - n), value=int(a[-1]))
                             for a, n in zip(accepted, lengths)]).to(device)  # [B, A]
        for layer in cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)
                block = x[:, :, prefix_len:]                                          # [B, H, N, D]
                gather = index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])  # [B, H, A, D]
                x[:, :, prefix_len:prefix_len + width] = block.gather(2, gather)
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :prefix_len + width]
        layer.values = layer.values[:, :, :prefix_len + width]
    return torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]


def compact_rows(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Close the holes (in place): every row's held slots move to the end, in order, and the columns no row needs
    are dropped. valid: [B, S] -> [B, S'] with S' the longest row's held slots."""
    held = int(valid.sum(dim=1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, valid.shape[1] - held:]  # [B, S']
    for layer in cache.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)
            setattr(layer, name, x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])))
    return valid.gather(1, order)
