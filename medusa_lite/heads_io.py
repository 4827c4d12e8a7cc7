"""The heads directory, written and read by this module only: ``medusa_config.json``, ``heads.safetensors``,
``tree.json`` and ``acceptance.json`` (never the target, never pickle), and the target fingerprint that keeps heads
from being loaded onto a target they were not trained for."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ._hf import text_config
from .config import CONFIG_NAME, TREE_NAME, WEIGHTS_NAME
from .drafters import DRAFTERS, MedusaConfig
from .drafters.registry import public_drafter
from .paths import PRETRAINED_ROOT, bundled_heads, hub_snapshot, is_hub_id
from .tree import load_tree, parse_tree, tree_json

PUBLIC_WEIGHTS = ("model.safetensors", "medusa_lm_head.safetensors")  # vLLM / SpecForge, FasterDecoding
_PROBE_ROWS = 8
_PROBE_COLS = 8


class HeadsMismatchError(ValueError):
    """Heads were trained for a different target."""


def target_fingerprint(target) -> dict[str, Any]:
    """Identity of a target that survives dtype changes: config shape hash + a probe of its ``lm_head``.

    The probe is a few ``lm_head`` entries, compared with a tolerance at load time (bf16 / GGUF
    de-quantisation keep them within a few percent; another model does not).
    """
    cfg = text_config(target.config)
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                                 "num_attention_heads", "intermediate_size")}
    weight = target.get_output_embeddings().weight
    rows = torch.linspace(0, weight.shape[0] - 1, _PROBE_ROWS).long()
    probe = weight.detach()[rows, :_PROBE_COLS].float().cpu().flatten().tolist()
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    return {"config_sha256": digest, "shape": shape, "lm_head_probe": [round(x, 5) for x in probe]}


def check_fingerprint(saved: dict[str, Any] | None, target, source: str) -> None:
    """Raise :class:`HeadsMismatchError` when ``saved`` does not describe ``target``."""
    if not saved:
        return
    current = target_fingerprint(target)
    if saved.get("config_sha256") != current["config_sha256"]:
        raise HeadsMismatchError(
            f"heads in {source} were trained for a target with {saved.get('shape')}, "
            f"but the given target has {current['shape']}")
    a = torch.tensor(saved.get("lm_head_probe", []))
    b = torch.tensor(current["lm_head_probe"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=0.05, atol=0.02 * float(b.abs().max()) + 1e-6):
        raise HeadsMismatchError(
            f"heads in {source} were trained for a different target (its lm_head weights differ): "
            "same architecture, other weights. Load them onto the target they were trained for.")


def save_heads(directory: str | Path, config: MedusaConfig, drafter: torch.nn.Module, acceptance=None) -> None:
    """Write ``medusa_config.json`` (the fallback tree in it), ``heads.safetensors`` and the acceptance table if there
    is one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save(directory)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "library": "medusa_lite"})
    if acceptance is not None:
        acceptance.save(directory)


def public_checkpoint(heads_dir: Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]] | None:
    """A drafter another project published (``config.json`` + ``model.safetensors``: vLLM / speculators, SpecForge,
    EAGLE) as (config, state) in this library's terms, or None for a medusa_lite directory."""
    public_config = heads_dir / "config.json"
    if (heads_dir / CONFIG_NAME).is_file() or not public_config.is_file():
        return None
    public = json.loads(public_config.read_text())
    drafter = public_drafter(public)
    if drafter is None:
        known = sorted(a for cls in DRAFTERS.values() for a in cls.PUBLIC_ARCHITECTURES)
        raise ValueError(f"{heads_dir}: config.json describes {public.get('architectures') or 'no architecture'}, "
                         f"not a drafter medusa_lite reads (its own {CONFIG_NAME}, {known}, or FasterDecoding's "
                         "Medusa heads)")
    weights = public_weights(heads_dir)
    config, state = drafter.import_public(public, load_file(str(weights)))
    return MedusaConfig.from_dict(config, source=str(public_config)), state


def resolve_heads_dir(heads: str | Path, revision: str | None = None) -> Path:
    """A local heads directory as it is; else the name of a bundled drafter (:func:`medusa_lite.paths.bundled_heads`);
    otherwise ``heads`` as a Hub repo id (``org/name``), downloaded or found in the local cache by
    ``huggingface_hub.snapshot_download`` (safetensors and JSON only)."""
    path = Path(heads)
    if path.is_dir():
        return path
    if str(heads) in bundled_heads():
        return PRETRAINED_ROOT / str(heads)
    if not is_hub_id(str(heads)):
        raise FileNotFoundError(f"{heads}: no such heads directory (nor a bundled drafter {bundled_heads()}, nor a "
                                "Hub repo id 'org/name')")
    try:
        return hub_snapshot(str(heads), revision, ["*.json", "*.safetensors"])
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{heads}: not a local directory, and {e}") from e


def public_weights(heads_dir: Path) -> Path:
    """A published checkpoint's safetensors file; pickled ones (``.pt``, ``.bin``) are refused, never unpickled."""
    for name in PUBLIC_WEIGHTS:
        if (heads_dir / name).is_file():
            return heads_dir / name
    pickled = sorted(p.name for p in heads_dir.iterdir() if p.suffix in (".pt", ".bin", ".pth"))
    if pickled:
        raise ValueError(f"{heads_dir}: {pickled} are pickle files, which medusa_lite does not load; convert them "
                         "to safetensors (safetensors.torch.save_file(torch.load(path, weights_only=True), "
                         f"'{PUBLIC_WEIGHTS[0]}'))")
    raise FileNotFoundError(f"{heads_dir}: none of {list(PUBLIC_WEIGHTS)}")


def read_heads(heads_dir: Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """(config, state on the CPU) of a heads directory, each file read once: its config class, with a legacy ``tree.json``'s
    tree where the config has none; a published checkpoint (:func:`public_checkpoint`) translated."""
    public = public_checkpoint(heads_dir)
    if public is not None:
        return public
    config = MedusaConfig.load(heads_dir)
    if (heads_dir / TREE_NAME).is_file() and config.tree is None:
        config.tree = tree_json(parse_tree(load_tree(heads_dir / TREE_NAME), config.num_heads))
    if not (heads_dir / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{heads_dir}: {WEIGHTS_NAME} is missing")
    return config, load_file(str(heads_dir / WEIGHTS_NAME))


def load_weights(drafter: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Load ``state`` (:func:`read_heads`) into ``drafter``; weights that do not match its config are an error."""
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{source} does not match its config: missing {missing}, unexpected {unexpected}")
