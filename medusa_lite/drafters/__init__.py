"""Drafters registered by name, as PEFT registers its tuners: ``head_type`` in a heads directory's
``medusa_config.json`` names the class that builds, drafts, trains and exports it.

>>> from medusa_lite.drafters import DRAFTERS, build_drafter
>>> sorted(DRAFTERS)
['eagle3', 'hydra', 'medusa']
"""

from __future__ import annotations

from .base import Draft, Drafter, DraftState, TreeShape

DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make ``cls`` the drafter of ``head_type == cls.name``."""
    if cls.name in DRAFTERS and DRAFTERS[cls.name] is not cls:
        raise ValueError(f"a drafter named {cls.name!r} is registered already ({DRAFTERS[cls.name].__name__})")
    DRAFTERS[cls.name] = cls
    return cls


def drafter_class(name: str) -> type[Drafter]:
    if name not in DRAFTERS:
        raise ValueError(f"head_type {name!r} is not a registered drafter (registered: {sorted(DRAFTERS)})")
    return DRAFTERS[name]


def drafter_features(hidden_states, layers: tuple[int, ...]):
    """A target forward's ``hidden_states`` -> the features of ``layers`` concatenated on the last dimension."""
    import torch

    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def build_drafter(config) -> Drafter:
    """A fresh drafter for ``config`` (its ``head_type``), not yet attached to a target."""
    return drafter_class(config.head_type)(config)


from . import eagle3, heads  # noqa: E402,F401  (registers medusa, hydra and eagle3)

__all__ = ["DRAFTERS", "Draft", "DraftState", "Drafter", "TreeShape", "build_drafter", "drafter_class", "drafter_features",
           "register_drafter"]
