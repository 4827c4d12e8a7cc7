"""The heads' configuration: their shape, the tree and the provenance, stored as ``medusa_config.json``.

The tree stored here is the no-fit fallback: decoding fits the tree to the machine it runs on from the heads'
acceptance table (:mod:`medusa_lite.fit`) and uses ``tree`` only where no fit is made (no table, ``fit=False``);
``medusa-lite calibrate`` writes the fit's own choice into it.

:class:`HeadsConfig` is the plain schema and its JSON I/O; it knows no drafter. The public
:class:`~medusa_lite.MedusaConfig` (:mod:`medusa_lite.drafters.registry`) adds the check of ``head_type`` against
the registered drafters and loads a saved config as its drafter's own config class."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._version import __version__
from .tree import parse_tree, tree_json, truncate

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "heads.safetensors"
TREE_NAME = "tree.json"  # legacy (written up to 0.1): its tree is read where the config has none
LEGACY_KEYS = ("dtype_trees",)  # written up to 0.1 (the offline chooser's tree per dtype); read as the fallback tree

# ~16-node tree grown by tree.grow_tree from prior per-head accuracies; replaced by calibration.
DEFAULT_TREE: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 0, 1],
    [0, 1, 0], [2, 0], [0, 0, 0, 0], [1, 1], [0, 3], [0, 0, 2],
]


@dataclass
class HeadsConfig:
    """Configuration of a set of draft heads (the schema; :class:`~medusa_lite.MedusaConfig` is what users build).

    ``hidden_size``/``vocab_size``/``base_model``/``target_fingerprint`` are filled from the target
    when the heads are attached (:class:`medusa_lite.MedusaModel`); the rest is chosen by the user.
    """

    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True          # shared frozen target lm_head (small) or per-head copies
    head_type: str = "medusa"           # the registered drafter (medusa_lite.drafters): "medusa" reads h_t,
                                        # "hydra" also the drafted path
    draft_vocab_size: int | None = None  # heads propose only these many tokens (ids stored with the weights)
    tree: list[list[int]] | dict | None = None  # the no-fit fallback: medusa_choices or {"dynamic": {...}};
                                                # None: default_tree()
    hidden_size: int | None = None
    vocab_size: int | None = None
    base_model: str | None = None
    target_fingerprint: dict[str, Any] | None = None
    training: dict[str, Any] = field(default_factory=dict)  # data, tokens seen, command, metrics
    library_version: str = __version__

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive integer, got {value!r}")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or self.draft_vocab_size < 1 or not self.share_lm_head):
            raise ValueError("MedusaConfig.draft_vocab_size must be a positive integer and needs share_lm_head=True")
        if self.tree is not None:
            self.tree = tree_json(parse_tree(self.tree, self.num_heads))

    @property
    def choices(self) -> list[list[int]] | dict:
        """The tree to decode with, in JSON form (a list of paths, or ``{"dynamic": {...}}``)."""
        return self.tree if self.tree is not None else self.default_tree()

    def default_tree(self, sample: bool = False) -> list[list[int]] | dict:
        """The tree of heads configured with none (``sample``: for sampling): :data:`DEFAULT_TREE`, as deep as the
        heads. A drafter's config class may choose another."""
        return truncate(DEFAULT_TREE, self.num_heads)

    def choices_for(self, sample: bool = False) -> list[list[int]] | dict:
        """The tree to decode with where no hardware fit is made: the stored ``tree``, else :meth:`default_tree`
        (``sample``: for sampling)."""
        return self.tree if self.tree is not None else self.default_tree(sample)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, strict: bool = True, source: str = "config") -> "HeadsConfig":
        """Build from a dict. Unknown keys raise when ``strict`` (user input) and warn otherwise (saved files)."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        data = _fold_legacy(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown and strict:
            raise ValueError(f"{source}: unknown MedusaConfig keys {unknown}; known keys: {sorted(known)}")
        if unknown:
            warnings.warn(f"{source}: ignoring unknown MedusaConfig keys {unknown}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "HeadsConfig":
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a medusa_lite heads directory: {CONFIG_NAME} is missing")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(data, strict=False, source=str(path))
        except TypeError as e:
            raise ValueError(f"{path}: malformed config: {e}") from e


def _fold_legacy(data: dict[str, Any]) -> dict[str, Any]:
    """A config written by 0.1: its fp32 greedy ``dtype_trees`` entry (what decoding used on the CPU) becomes the
    fallback ``tree`` where none is stored; the per-dtype trees themselves are no longer kept."""
    legacy = {k: data[k] for k in LEGACY_KEYS if k in data}
    if not legacy:
        return data
    data = {k: v for k, v in data.items() if k not in LEGACY_KEYS}
    by_dtype = legacy.get("dtype_trees")
    if data.get("tree") is None and isinstance(by_dtype, dict) and "float32" in by_dtype:
        data["tree"] = by_dtype["float32"]
    return data
