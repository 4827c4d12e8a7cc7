"""What a finished run leaves: the heads directory with its README.md card, and the command that made it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .engine import Engine
from .runtime import Runtime, barrier


def save_heads(cfg: TrainConfig, model, engine: Engine, rt: Runtime, provenance: dict[str, Any]) -> Path:
    """Heads directory (MedusaModel.save_pretrained) + README.md card; full weights under ZeRO-3."""
    out = Path(cfg.output_dir) / "heads"
    with engine.gathered():
        if rt.rank == 0:
            model.config.training = provenance
            model.save_pretrained(out)
            (out / "README.md").write_text(model_card(provenance))
    barrier(rt)
    return out


def launch_command(rt: Runtime, argv: list[str]) -> str:
    """The command line that started this run, as a user would type it."""
    args = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    if rt.world > 1 and "LOCAL_RANK" in os.environ:
        return " ".join(["deepspeed", "--num_gpus", str(rt.world), "--module", "medusa_lite.train.train", *args])
    original = getattr(sys, "orig_argv", [])[:3]
    if "medusa_lite.train.train" in original:
        return " ".join(["python -m medusa_lite.train.train", *args])
    return " ".join(["medusa-lite train", *args])


def acceptance_lines(p: dict[str, Any]) -> str:
    """The card's acceptance length: tokens per verify step in the real decoding loop, which heads were kept, and the
    evaluations they were chosen from."""
    ev = p.get("eval", {})
    if "accept_length" not in ev:
        return ""
    history = ", ".join(f"{h['step']}: {h['accept_length']:.3f}" for h in p.get("eval_history", [])
                        if h.get("accept_length") is not None)
    return (f"\nAcceptance length: **{ev['accept_length']:.3f} tokens per verify step** (accepted + 1) in "
            f"medusa_lite's verify loop on {ev['accept_prompts']} held-out prompts x {ev['accept_tokens']} new tokens, "
            f"greedy, {ev.get('accept_dtype', '')}, tree `{json.dumps(ev['accept_tree'])}` without prompt lookup or "
            "hardware fit (what `medusa-lite bench --tree` that tree counts as tokens per forward). These heads are "
            f"step {ev.get('heads_step', p['steps'])}'s, the best acceptance length of the run's evaluations "
            f"(step: tokens per step): {history}.\n")


def model_card(p: dict[str, Any]) -> str:
    """The heads directory's README.md, rendered from the provenance stored in ``MedusaConfig.training``."""
    ev, cfg, data = p.get("eval", {}), p.get("config", {}), p["data"]
    accept = ev.get("accept_t1") or ["-"] * len(ev.get("top1", []))  # (absent from evaluations before it)
    rows = "\n".join(f"| {k + 1} | {ev['top1'][k]:.3f} | {ev['top5'][k]:.3f} | {accept[k]} |"
                     for k in range(len(ev.get("top1", []))))
    lm_head = "shared frozen target lm_head" if cfg.get("share_lm_head", True) else "per-head lm_head"
    vocab = (f"; the heads propose from the {cfg['draft_vocab']} most frequent trained tokens "
             f"({p.get('draft_vocab_coverage', 0):.4f} of trained tokens; `draft_ids` in the weights), in training "
             "and decoding") if cfg.get("draft_vocab") else ""
    head_type = cfg.get("head_type", "medusa")
    shape = {"medusa": f"{p['num_heads']} Medusa heads ({p['num_layers']} ResBlock each, {lm_head})",
             "hydra": f"{p['num_heads']} Hydra (sequentially dependent) heads ({p['num_layers']} ResBlock each, "
                      f"{lm_head})",
             "eagle3": f"An EAGLE-3 drafter (one decoder layer over three target layers, its own lm_head; "
                       f"{p['num_heads']} steps unrolled in training)"}.get(head_type, f"A {head_type} drafter")
    return f"""# Draft heads for {p['base_model']}

{shape} trained by medusa_lite
{p['library_version']} with `{p['loss']}` self-distillation on the frozen target{vocab}.

- data: `{data['data']}` ({data['train_docs']} training documents, {data['train_tokens']} tokens of which
  {data['train_loss_tokens']} assistant tokens; {data['eval_docs']} held-out documents; documents truncated to
  {cfg.get('max_doc_len')} tokens)
- tokens seen (trained head-1 positions, all epochs): {p['tokens_seen']}
- steps: {p['steps']}, global batch {p['global_batch_windows']} windows x {p['seq_len']} tokens
- wall time: {p['wall_seconds'] / 60:.1f} min in total, training {p['train_seconds'] / 60:.1f} min at
  {p['positions_per_s']:.0f} positions/s
- hardware: {p['hardware']} ({p['world_size']} process(es), engine: {p['engine']})
- command: `{p['command']}`

Held-out agreement with the target's greedy token ({ev.get('eval_positions', 0)} assistant positions of
held-out documents; the heads ranking the vocabulary they decode with): head k proposes the token k
positions after the target's own next token{', reading the true tokens before it' if head_type != 'medusa' else ''}.

| head | top-1 | top-5 | sampled acceptance (T = 1) |
|---:|---:|---:|---:|
{rows}
{acceptance_lines(p)}

The full training config is `training.config` in `medusa_config.json`.
"""
