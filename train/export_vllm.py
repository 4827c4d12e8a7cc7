"""Write medusa_lite heads in the checkpoint layout vLLM's Medusa proposer loads.

    medusa-lite export-vllm HEADS_DIR OUT_DIR [--target PATH_OR_HUB_ID] [--dtype bf16]

OUT_DIR gets ``config.json`` ({"model_type": "medusa", "architectures": ["MedusaModel"], ...}) and
``model.safetensors`` with ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight``. vLLM
silently ignores unknown tensor names (the heads would then accept ~0%), so the names are tested.
Heads trained with a shared lm_head get the target's lm_head weight written once per head, so the
target is loaded (``--target``; default: the heads' recorded base model, or the bundled default).
Heads with a reduced draft vocabulary get those rows only, ``truncated_vocab_size`` and vLLM's
``token_map``. Each drafter writes its own layout (``Drafter.export_vllm``); Hydra heads have no vLLM
counterpart and are refused, naming why.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from medusa_lite.config import WEIGHTS_NAME
from medusa_lite.drafters import MedusaConfig
from medusa_lite.drafters import drafter_class
from medusa_lite.settings import SettingsParser, TargetOptions, option
from medusa_lite._hf import parse_dtype
from medusa_lite.targets import DEFAULT_TARGET, load_target

def export_vllm(heads_dir: str | Path, out_dir: str | Path, *, lm_head_weight: torch.Tensor | None = None,
                dtype: str | torch.dtype = "bf16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` for vLLM into ``out_dir``; returns it."""
    heads_dir, out_dir = Path(heads_dir), Path(out_dir)
    config = MedusaConfig.load(heads_dir)
    state = load_file(str(heads_dir / WEIGHTS_NAME))
    vllm_config, tensors = drafter_class(config.head_type).export_vllm(config, state, lm_head_weight,
                                                                       parse_dtype(dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@dataclass
class ExportSettings(TargetOptions):
    """``medusa-lite export-vllm HEADS_DIR OUT_DIR`` options: these defaults < ``--config FILE`` < flags. The target
    (for a shared lm_head) defaults to the heads' recorded base model, else the bundled default target."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "bf16", "the target's dtype and the written tensors'; auto: bf16 on a CUDA device that runs it natively, "
                "else fp32", kw_only=True)


def main(argv: list[str] | None = None) -> None:
    parser = SettingsParser(ExportSettings, prog="medusa-lite export-vllm", description=__doc__, kind="export-vllm")
    parser.add_argument("heads_dir", help="medusa_lite heads directory")
    parser.add_argument("out_dir", help="vLLM checkpoint directory to write")
    settings, paths = parser.parse(argv)
    settings.resolve()
    args = argparse.Namespace(**vars(settings), **vars(paths))
    config = MedusaConfig.load(args.heads_dir)
    refusal = drafter_class(config.head_type).vllm_refusal
    if refusal:
        raise ValueError(f"vLLM cannot run {config.head_type!r} drafters: {refusal}")
    lm_head_weight = None
    if config.share_lm_head:
        if settings.target is None and config.base_model not in (None, DEFAULT_TARGET):
            settings.target = config.base_model
        target, _ = load_target(**settings.load_kwargs())
        from medusa_lite.heads_io import check_fingerprint

        check_fingerprint(config.target_fingerprint, target, args.heads_dir)
        lm_head_weight = target.get_output_embeddings().weight.cpu()
    out = export_vllm(args.heads_dir, args.out_dir, lm_head_weight=lm_head_weight, dtype=args.dtype)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote a vLLM {architecture} checkpoint to {out}")


if __name__ == "__main__":
    main()
