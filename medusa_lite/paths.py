"""Where things are: the user's cache folder, the files shipped with the package and snapshots of Hub repos in the
Hugging Face cache (a leaf: no project import)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_PACKAGE = Path(__file__).parent
# the shipped configs: the checkout's top-level configs/, installed as the package medusa_lite.configs
CONFIGS_DIR = Path(list(importlib.util.find_spec("medusa_lite.configs").submodule_search_locations)[0])
PRETRAINED_ROOT = _PACKAGE / "pretrained"         # one folder per bundled drafter of the default target
PRETRAINED_DIR = PRETRAINED_ROOT / "smollm2-135m-instruct"  # the default: what ``--heads`` unset loads
_SUFFIXES = {"train": ".yaml", "serve": ".yaml", "campaign": ".yaml", "deepspeed": ".json", "trees": ".json"}


def cache_dir() -> Path:
    """``$MEDUSA_LITE_CACHE``, default ``~/.cache/medusa_lite``: converted targets and hardware fits."""
    return Path(os.environ.get("MEDUSA_LITE_CACHE", Path.home() / ".cache" / "medusa_lite"))


def bundled_heads() -> list[str]:
    """Names of the drafters shipped with the package (``--heads NAME`` loads one; the first is the default)."""
    names = sorted(p.name for p in PRETRAINED_ROOT.iterdir() if (p / "medusa_config.json").is_file())
    return sorted(names, key=lambda name: name != PRETRAINED_DIR.name)  # stable: the default, then the rest


def shipped_configs(kind: str) -> list[str]:
    """Names of the files shipped under ``configs/<kind>/``."""
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob(f"*{_SUFFIXES.get(kind, '')}"))


def resolve_config(kind: str, name_or_path: str | Path) -> Path:
    """An existing path as given, else the shipped ``configs/<kind>/<name>``: ``'zero2'``, ``'zero2.json'`` and
    ``'configs/deepspeed/zero2.json'`` (a checkout-relative path of earlier versions) all name the same file."""
    path = Path(name_or_path).expanduser()
    shipped = CONFIGS_DIR / kind / (path.stem + _SUFFIXES.get(kind, path.suffix))
    if path.is_file():  # a shipped file given by a path (e.g. relative to the checkout) is named as shipped
        return shipped if shipped.is_file() and path.resolve() == shipped.resolve() else path
    if shipped.is_file() and (path.parent == Path(".") or path.parent.as_posix().endswith(f"configs/{kind}")):
        return shipped
    raise FileNotFoundError(f"{kind} config {str(name_or_path)!r}: no such file, and not one of the shipped "
                            f"{kind} configs {shipped_configs(kind)}")


class TargetError(OSError):
    """A target that could not be found or loaded; the message says what was tried (a command prints it, no
    traceback)."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub repo id, ``org/name`` (a path that exists locally never is one)."""
    parts = str(name).split("/")
    return len(parts) == 2 and all(parts) and not str(name).startswith((".", "~")) and not Path(name).exists()


def hub_snapshot(repo_id: str, revision: str | None, patterns: list[str], ignore: list[str] | None = None) -> Path:
    """The local folder of ``repo_id`` at ``revision`` (None: main) through ``huggingface_hub.snapshot_download``: the
    Hugging Face cache when it holds it (all there is with ``HF_HUB_OFFLINE=1``), else the files matching
    ``patterns`` (and not ``ignore``) downloaded. ``FileNotFoundError`` naming the repo, revision and cache when it cannot be read."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=ignore))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        offline = " (HF_HUB_OFFLINE: the cache only)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(f"the Hub repo {repo_id} at revision {revision or 'main'} could not be read from the "
                                f"cache {constants.HF_HUB_CACHE}{offline} or the Hub ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from e
