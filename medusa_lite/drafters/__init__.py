"""Drafters registered by name, as PEFT registers its tuners: ``head_type`` in a heads directory's
``medusa_config.json`` names the class that builds, drafts, trains and exports it (:mod:`.registry`).

>>> from medusa_lite.drafters import DRAFTERS, build_drafter
>>> sorted(DRAFTERS)
['eagle3', 'hydra', 'medusa']
"""

from __future__ import annotations

from . import eagle3, heads  # noqa: F401  (importing them registers medusa, hydra and eagle3)
from .base import Draft, Drafter, DraftState, TreeShape, drafter_features, num_positions, per_row
from .runtime import RUNTIME, DraftRuntime
from .registry import DRAFTERS, MedusaConfig, as_drafter_config, build_drafter, config_class, drafter_class, register_drafter

__all__ = ["DRAFTERS", "Draft", "DraftRuntime", "DraftState", "Drafter", "RUNTIME", "MedusaConfig", "TreeShape", "as_drafter_config",
           "build_drafter", "config_class", "drafter_class", "drafter_features", "num_positions", "per_row",
           "register_drafter"]
