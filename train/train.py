"""Fine-tune draft heads on a frozen target (self-distillation); DeepSpeed is the engine, on one CPU or many GPUs.

    medusa-lite train --config smollm2-135m [--key value | key=value ...]
    deepspeed --num_gpus 8 --module medusa_lite.train.train --config smollm2-135m [--key value ...]

Stages: parse (defaults < YAML < key=value) -> build (target, heads, data, engine) -> run (steps,
checkpoints, JSONL log) -> save (held-out evaluation, heads directory with card).
The target is frozen; the optimizer sees only the heads. With ``cache_features`` the target's
final-norm hidden states are computed once per document and reused every epoch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from medusa_lite.machine import hardware_summary
from medusa_lite.settings import SettingsParser
from medusa_lite.train import data as D

from .acceptance import held_out_prompts
from .card import launch_command, save_heads
from .config import TrainConfig, resolve_precision
from .engine import Engine
from .features import cached_features
from .loop import Evaluations, choose_draft_vocabulary, run, trained_token_counts
from .runtime import Runtime, init_runtime, leave, log0
from .shard import ShardedTarget, partitioned_loading


def settings_parser() -> SettingsParser:
    parser = SettingsParser(TrainConfig, prog="medusa-lite train", description=__doc__, kind="train")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return parser


def build_config(config: str | None, overrides: list[str]) -> TrainConfig:
    """Defaults < the YAML ``config`` (a path or a shipped name) < ``overrides`` (``key=value`` or flags)."""
    return settings_parser().parse((["--config", config] if config else []) + list(overrides))[0]


# ================================================================================================ build
def build_model(cfg: TrainConfig, rt: Runtime):
    """Frozen target + fresh heads (fp32 master weights). Returns (MedusaModel, tokenizer)."""
    from medusa_lite import MedusaModel
    from medusa_lite.drafters import config_class
    from medusa_lite.targets import DEFAULT_TARGET, load_target

    with partitioned_loading(cfg, rt):  # shard_target: no rank ever holds the whole target
        target, tokenizer = load_target(cfg.target, dtype=cfg.dtype, device=rt.device, adapter=cfg.adapter,
                                        revision=cfg.revision)
    if cfg.shard_target:
        ShardedTarget(target, rt)  # its layers stay partitioned; what the drafter reads is made whole
    shape = {"aux_layers": list(cfg.aux_layers)} if cfg.aux_layers else {}
    if cfg.intermediate_size:
        shape["intermediate_size"] = cfg.intermediate_size
    head_cfg = config_class(cfg.head_type)(
        num_heads=cfg.num_heads, num_layers=cfg.num_layers, share_lm_head=cfg.share_lm_head, head_type=cfg.head_type,
        draft_vocab_size=_draft_vocab_size(cfg, target), base_model=cfg.target or DEFAULT_TARGET, **shape)
    torch.manual_seed(cfg.seed)
    model = MedusaModel(target, head_cfg)  # freezes the target: requires_grad False, eval()
    model.drafter.float()
    return model, tokenizer


def warm_start(model, heads_dir: str | Path, data: D.TokenData | None = None) -> int | None:
    """Load a saved drafter's weights (and draft vocabulary) into ``model``'s fresh drafter of the same shape; a
    larger draft vocabulary than the saved one is grown from it with ``data`` (:func:`grow_vocabulary`). Returns the
    saved vocabulary's size when it grew."""
    from medusa_lite.heads_io import load_weights, read_heads

    saved, state = read_heads(Path(heads_dir))
    grown_from = None
    for key in ("head_type", "num_heads", "num_layers", "draft_vocab_size"):
        if getattr(saved, key) == getattr(model.config, key):
            continue
        if key == "draft_vocab_size" and data is not None and grows(saved.draft_vocab_size, model.config):
            state, grown_from = grow_vocabulary(model, state, trained_token_counts(model, data)), saved.draft_vocab_size
            continue
        raise ValueError(f"init_heads={heads_dir}: its {key} is {getattr(saved, key)!r}, this run's "
                         f"{getattr(model.config, key)!r}" + (" (a draft vocabulary can grow, not shrink)"
                                                                if key == "draft_vocab_size" else ""))
    load_weights(model.drafter, state, Path(heads_dir))
    return grown_from


def grows(saved_size: int | None, config) -> bool:
    """Whether a drafter saved with a ``saved_size`` draft vocabulary can start one of ``config``'s larger one."""
    return saved_size is not None and (config.draft_vocab_size or config.vocab_size) > saved_size


def grow_vocabulary(model, state: dict[str, torch.Tensor], counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """``state`` (a saved drafter's weights) fitted to ``model``'s larger draft vocabulary: every saved token stays
    with its trained rows; the most frequent trained tokens (``counts`` [V]) fill the rest, their rows as a fresh
    drafter starts them (the target's own, :meth:`Drafter.vocabulary_changed`) carried into the trained rows' space
    (:func:`merge_vocabulary_rows`)."""
    old = state["draft_ids"]                                            # [V0] sorted token ids
    size = model.config.draft_vocab_size or model.config.vocab_size
    counts = counts.clone().float()
    counts[old] = -1.0                                                  # already in: not drawn again
    new = torch.cat([old, counts.topk(size - old.numel()).indices]).sort().values  # [V1]
    drafter = model.drafter
    if model.config.draft_vocab_size is not None:
        drafter.draft_ids.copy_(new.to(drafter.draft_ids.device))
    drafter.vocabulary_changed()
    fresh = drafter.state_dict()
    rows = torch.searchsorted(new, old)                                 # [V0]: where the saved tokens now sit
    grown = {}
    for key, tensor in state.items():
        if key == "draft_ids":
            continue
        if tensor.shape != fresh[key].shape and tensor.shape[0] == old.numel() and fresh[key].shape[0] == new.numel():
            tensor = merge_vocabulary_rows(fresh[key], tensor.to(fresh[key].dtype), rows)
        grown[key] = tensor
    if model.config.draft_vocab_size is not None:
        grown["draft_ids"] = new
    return grown


def merge_vocabulary_rows(fresh: torch.Tensor, trained: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A grown vocabulary tensor: ``trained`` [V0, ...] at ``rows`` [V0] of ``fresh`` [V1, ...]; the other rows
    (the new tokens) start as their fresh rows carried by the least-squares linear map that takes the saved tokens'
    fresh rows to their trained ones. Training moves the rows a long way from where they started (the EAGLE-3
    lm_head: cosine 0.40 to the target's rows), so new tokens started at the bare fresh rows outscore the trained
    ones and a grown drafter began far behind the one it grew from (held-out top-1 0.64 -> 0.27); mapped, they
    start in the trained rows' space."""
    merged = fresh.clone()
    if fresh.dim() == 2:
        new = torch.ones(fresh.shape[0], dtype=torch.bool, device=fresh.device)
        new[rows] = False
        start = fresh[rows].float()                                     # [V0, H]
        carry = torch.linalg.lstsq(start, trained.float()).solution     # [H, H]: start @ carry ~ trained
        merged[new] = (fresh[new].float() @ carry).to(fresh.dtype)      # [V1 - V0, H]
    merged[rows] = trained
    return merged


def start_drafter(cfg: TrainConfig, model, train_data: D.TokenData, rt: Runtime) -> None:
    """A fresh run's starting point: ``init_heads``' weights, else the draft vocabulary of this data."""
    if cfg.init_heads:
        grown_from = warm_start(model, cfg.init_heads, train_data)
        log0(rt, f"warm start from {cfg.init_heads} (its weights and draft vocabulary"
                 + (f", grown from {grown_from} tokens)" if grown_from else ")"))
    else:
        choose_draft_vocabulary(cfg, model, train_data)


def report_shard(model, rt: Runtime) -> dict[str, Any] | None:
    """With ``shard_target``: every rank's measured share of the target's parameters, logged (None otherwise)."""
    shard = ShardedTarget.of(model.base_model)
    if shard is None:
        return None
    report = shard.report(model.base_model)
    log0(rt, f"shard_target: the target's {report['parameters']} parameters, held per rank "
             f"{report['held_per_rank']} (fractions {report['fraction_per_rank']}); a layer's forward gathers at most "
             f"{report['largest_layer_fraction']:.1%} more")
    return report


def _draft_vocab_size(cfg: TrainConfig, target) -> int | None:
    vocab = target.get_output_embeddings().weight.shape[0]
    return cfg.draft_vocab if cfg.draft_vocab is not None and cfg.draft_vocab < vocab else None


def build_data(cfg: TrainConfig, tokenizer, rt: Runtime) \
        -> tuple[D.TokenData, D.TokenData | None, dict[str, Any], list[torch.Tensor]]:
    """(train, held-out) token streams, a summary of what was read and the held-out prompts the acceptance length is
    measured on."""
    records, skipped, paths = D.read_sources(cfg.data, seed=cfg.seed)
    own_eval = 0 if cfg.eval_data else cfg.eval_samples
    if cfg.max_samples is not None:
        records = records[: cfg.max_samples + own_eval]
    if len(records) <= own_eval:
        raise ValueError(f"{cfg.data}: {len(records)} valid records, need more than "
                         + (f"eval_samples={cfg.eval_samples}" if own_eval else "0"))
    if skipped:
        log0(rt, f"data: skipped {sum(skipped.values())} malformed record(s): {dict(skipped)}")
    held, train = records[:own_eval], records[own_eval:]
    if cfg.eval_data:
        held, eval_skipped = D.read_records(D.resolve_data_path(cfg.eval_data), limit=cfg.eval_samples, seed=cfg.seed)
        if not held:
            raise ValueError(f"eval_data {cfg.eval_data}: no valid record ({dict(eval_skipped)})")
        seen = {json.dumps(r, sort_keys=True) for r in held}
        kept = [r for r in train if json.dumps(r, sort_keys=True) not in seen]
        if len(kept) < len(train):
            log0(rt, f"data: {len(train) - len(kept)} record(s) of data are held out in eval_data; not trained on")
        train = kept
    train_data = D.build_token_data(tokenizer, train, max_len=cfg.max_doc_len, num_proc=cfg.num_proc)
    eval_data = D.build_token_data(tokenizer, held, max_len=cfg.max_doc_len) if held else None
    prompts = held_out_prompts(tokenizer, held, cfg.accept_prompts, cfg.max_doc_len)
    summary = {"data": cfg.data, "path": ",".join(map(str, paths)), "eval_data": cfg.eval_data,
               "train_docs": train_data.num_docs,
               "train_tokens": int(train_data.ids.numel()), "train_loss_tokens": train_data.num_loss_tokens,
               "eval_docs": eval_data.num_docs if eval_data else 0,
               "eval_loss_tokens": eval_data.num_loss_tokens if eval_data else 0,
               "skipped_records": dict(skipped), "accept_prompts": len(prompts)}
    log0(rt, "data: " + json.dumps(summary))
    return train_data, eval_data, summary, prompts


# ================================================================================================ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    t0 = time.time()
    # --- parse
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = settings_parser().parse(argv)[0]
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rt = init_runtime(cfg)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    requested = cfg.precision
    cfg.precision, why = resolve_precision(cfg.precision, rt.device)
    log0(rt, f"precision: {cfg.precision}" + (f" (auto: {why})" if requested == "auto" else ""))
    cfg.device = str(rt.device)
    if cfg.dtype == "auto":  # the target computes in the training precision unless told otherwise
        cfg.dtype = cfg.precision
    log0(rt, "config: " + json.dumps(dataclasses.asdict(cfg)))
    # --- build
    model, tokenizer = build_model(cfg, rt)
    shard_report = report_shard(model, rt)
    train_data, eval_data, data_summary, prompts = build_data(cfg, tokenizer, rt)
    train_hidden = cached_features(cfg, model, train_data, rt, "train") if cfg.cache_features else None
    eval_hidden = cached_features(cfg, model, eval_data, rt, "eval") \
        if cfg.cache_features and eval_data else None
    start_drafter(cfg, model, train_data, rt)
    engine = Engine(cfg, model.drafter, rt)
    evals = Evaluations(cfg, model, engine, eval_data, eval_hidden, prompts, rt,
                        ShardedTarget.of(model.base_model)) if eval_data else None
    # --- run
    stats = run(cfg, model, engine, train_data, train_hidden, rt, evals)
    if not stats["finished"]:
        log0(rt, f"stopped at step {stats['step']} of {cfg.max_steps} (max_steps_this_run); resume to finish")
        leave(rt)
        return {"stats": stats}
    # --- save
    metrics = evals.result(stats["step"]) if evals else {}  # the best-by-acceptance heads, loaded to be saved
    log0(rt, "eval: " + json.dumps(metrics))
    provenance = {
        "base_model": model.config.base_model, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
        "library_version": model.config.library_version, "loss": cfg.loss, "data": data_summary,
        "tokens_seen": stats["tokens"], "steps": stats["step"], "seq_len": cfg.seq_len,
        "global_batch_windows": cfg.micro_batch_size * cfg.grad_accum * rt.world,
        "train_seconds": round(stats["train_seconds"], 1), "wall_seconds": round(time.time() - t0, 1),
        "positions_per_s": stats["this_run_steps"] * stats["positions_per_step"] / max(stats["this_run_seconds"], 1e-9),
        "hardware": hardware_summary(), "world_size": rt.world,
        "engine": f"deepspeed ZeRO-{engine.zero_stage}", "target_shard": shard_report,
        "command": launch_command(rt, argv), "draft_vocab_coverage": stats["draft_vocab_coverage"],
        "eval": metrics, "eval_history": evals.best.history if evals else [], "config": dataclasses.asdict(cfg),
    }
    heads_dir = save_heads(cfg, model, engine, rt, provenance)
    log0(rt, f"saved heads to {heads_dir}")
    leave(rt)
    return {"stats": stats, "eval": metrics, "heads_dir": str(heads_dir)}


if __name__ == "__main__":
    main()
