"""Drafters registered by name, as PEFT registers its tuners, and the config that dispatches on the registry.

``head_type`` in a heads directory's ``medusa_config.json`` names the class that builds, drafts, trains and exports
it (:func:`register_drafter`); :class:`MedusaConfig` checks ``head_type`` against the registry and loads a saved
config as the registered drafter's own config class (e.g. :class:`~medusa_lite.drafters.eagle3.Eagle3Config`).
The plain schema and its JSON I/O are :class:`medusa_lite.config.HeadsConfig`, which knows no drafter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import HeadsConfig
from .base import Drafter

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


def public_drafter(public: dict) -> type[Drafter] | None:
    """The drafter that imports a published checkpoint with this ``config.json``, if any."""
    return next((cls for cls in DRAFTERS.values() if cls.reads_public(public)), None)


def build_drafter(config) -> Drafter:
    """A fresh drafter for ``config`` (its ``head_type``), not yet attached to a target."""
    return drafter_class(config.head_type)(config)


@dataclass
class MedusaConfig(HeadsConfig):
    """Configuration of a set of draft heads (:class:`~medusa_lite.config.HeadsConfig`) whose ``head_type`` names a
    registered drafter; :meth:`from_dict` / :meth:`load` return that drafter's own config class."""

    def __post_init__(self) -> None:
        super().__post_init__()
        drafter = drafter_class(self.head_type)  # ValueError naming the registered ones
        if "dynamic" in str(self.tree):
            drafter.require_dynamic_trees()

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, strict: bool = True, source: str = "config") -> "MedusaConfig":
        """Build from a dict. Unknown keys raise when ``strict`` (user input) and warn otherwise (saved files)."""
        if cls is MedusaConfig and isinstance(data, dict) and isinstance(data.get("head_type"), str):
            drafter = DRAFTERS.get(data["head_type"])
            if drafter is not None and drafter.config_class not in (None, cls):
                return drafter.config_class.from_dict(data, strict=strict, source=source)
        return super().from_dict(data, strict=strict, source=source)


def config_class(head_type: str) -> type[MedusaConfig]:
    """The config class of the drafter registered as ``head_type``."""
    return drafter_class(head_type).config_class or MedusaConfig


def as_drafter_config(config: HeadsConfig) -> MedusaConfig:
    """``config`` as its drafter's own config class (e.g. ``MedusaConfig(head_type="eagle3")`` -> an Eagle3Config)."""
    cls = config_class(config.head_type)
    if isinstance(config, cls):
        return config
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
