"""The training config: every option flat, with its default and help; defaults < YAML < command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from medusa_lite.settings import Ints, TargetOptions, option


@dataclass
class TrainConfig(TargetOptions):
    """Every training option, flat (the target's first: :class:`TargetOptions`). Precedence: these defaults < the YAML
    file < command-line flags."""

    # target (its dtype follows the training precision unless told)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "the target's dtype; auto: the resolved precision's (bf16 or fp32)", kw_only=True)
    adapter: str | None = option(None, "PEFT (LoRA) adapter directory, merged into the target")
    # heads
    head_type: str = option("medusa", "the registered drafter: medusa (heads read h_t only), hydra (heads also read "
                                      "the drafted path), eagle3 (one decoder layer over three target layers)")
    num_heads: int = option(4, "draft depth: heads, or eagle3's steps unrolled in training (training-time test)")
    num_layers: int = option(1, "ResBlocks per head (medusa, hydra)")
    share_lm_head: bool = option(True, "heads project with the frozen target lm_head (else one lm_head each)")
    aux_layers: Ints | None = option(None, "eagle3: the target hidden_states it reads (none: 2, L // 2, L - 3)")
    intermediate_size: int | None = option(None, "eagle3: its MLP width (none: the target's)")
    init_heads: str | None = option(None, "a heads directory of the same shape whose weights (draft vocabulary "
                                          "included) a fresh run starts from; a larger draft_vocab grows from its "
                                          "vocabulary; a checkpoint to resume wins")
    # data
    data: str = option("sharegpt", "'sharegpt' or a .json / .jsonl file (chat messages or {\"text\"}); several "
                                   "comma-separated, each optionally NAME[start:stop] of its seeded shuffle")
    max_samples: int | None = option(2000, "documents used for training, after a seeded shuffle (none: all)")
    eval_samples: int = option(50, "held-out documents (disjoint from training)")
    eval_data: str | None = option(None, "held-out documents from this .json / .jsonl file (the first eval_samples "
                                         "after the seeded shuffle; none: from data): a metric that stays comparable "
                                         "when data grows")
    eval_every: int | None = option(None, "evaluate on the held-out documents every N steps (none: at every "
                                          "checkpoint, save_every; 0: at the end only); the heads of the evaluation "
                                          "with the best acceptance length are the run's result")
    accept_prompts: int = option(8, "held-out prompts each evaluation decodes to measure the acceptance length "
                                    "(tokens per verify step; 0: not measured, the final heads are the result)")
    accept_tokens: int = option(128, "new tokens decoded per prompt for the acceptance length (acceptance grows "
                                      "along an answer: fewer tokens understate the bench's 256)")
    accept_tree: str | None = option(None, "tree the acceptance length is measured with (a JSON file or a shipped "
                                           "name); none: the heads' stored tree; without its lookup branch either way")
    max_doc_len: int = option(1024, "documents are truncated to this many tokens")
    seq_len: int = option(256, "training window length")
    windows: Literal["stream", "document"] = option(
        "stream", "stream: overlapping windows over the concatenated documents; document: each window starts at a "
                  "document and holds whole ones (needs max_doc_len <= seq_len), so an attending drafter (eagle3) "
                  "trains with the whole prompt in view, as it decodes")
    num_proc: int | None = option(None, "datasets.map workers")
    # loss / optimisation
    loss: Literal["kl", "ce", "tvd", "kl+tvd"] = option(
        "kl", "kl: self-distillation to the target; ce: the data's tokens; tvd: total variation to the target (one "
              "minus the expected acceptance of a sampled draft); kl+tvd: both")
    decay: float = option(0.8, "head k's loss weight is decay**k")
    lr: float = option(1e-3, "peak learning rate (AdamW, warmup then cosine)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(20, "linear warmup steps")
    max_steps: int = option(200, "optimiser steps in all")
    micro_batch_size: int = option(4, "windows per rank per micro step")
    grad_accum: int = option(1, "micro steps per optimiser step")
    grad_clip: float = option(1.0, "gradient norm clipping")
    precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", "bf16: target bf16, heads fp32 under bf16 autocast; fp32; auto: bf16 where the hardware runs "
                "bf16 matmuls natively, else fp32")
    cache_features: bool = option(True, "compute the target's final-norm hidden states once and reuse them")
    draft_vocab: int | None = option(None, "heads propose only the N most frequent training tokens (training and "
                                           "decoding read N lm_head rows instead of all; stored in the heads)")
    threads: int | None = option(None, "torch.set_num_threads (1 is fastest on a busy shared CPU)")
    # engine
    deepspeed: str = option("zero2", "DeepSpeed JSON of the drafter's engine: a path or a shipped name (zero2, zero3)")
    shard_target: bool = option(False, "partition the frozen target's decoder layers across the ranks (DeepSpeed "
                                       "ZeRO-3: each holds 1/world of them; embeddings and lm_head whole), for a "
                                       "target no one device holds")
    # run
    output_dir: str = option("runs/heads", "checkpoints, features, log and the trained heads go here")
    save_every: int = option(100, "checkpoint every N steps (0: only at the end); the newest keep_checkpoints stay")
    keep_checkpoints: int = option(2, "checkpoints kept in output_dir/checkpoints (0: all)")
    log_every: int = option(10, "log to train_log.jsonl every N steps")
    resume: bool = option(True, "continue from the latest checkpoint in output_dir")
    max_steps_this_run: int | None = option(None, "stop (with a checkpoint) after this many steps of this run")
    time_limit_minutes: float | None = option(None, "stop training (checkpoint, eval, save) after this wall time")
    seed: int = option(0, "seed of the data order and the heads' initialisation")
    progress: bool = option(True, "tqdm progress bars")

    def __post_init__(self) -> None:
        from medusa_lite.drafters import DRAFTERS
        from medusa_lite.drafters.heads import LOSSES

        for name, allowed in (("loss", LOSSES), ("head_type", tuple(sorted(DRAFTERS))),
                              ("precision", ("auto", "bf16", "fp32"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_heads", "num_layers", "seq_len", "max_steps", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("accept_prompts", "eval_every"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.accept_tokens < 1:
            raise ValueError(f"accept_tokens must be >= 1, got {self.accept_tokens}")
        if self.shard_target and self.adapter:
            raise ValueError("shard_target takes no adapter (a LoRA merge needs the whole target)")
        if self.draft_vocab is not None and not self.share_lm_head:
            raise ValueError("draft_vocab needs share_lm_head=True (per-head lm_heads span the full vocabulary)")
        if self.head_type != "eagle3" and (self.aux_layers is not None or self.intermediate_size is not None):
            raise ValueError("aux_layers and intermediate_size shape an eagle3 drafter (head_type=eagle3)")
        if self.seq_len <= self.num_heads + 1:
            raise ValueError(f"seq_len={self.seq_len} must exceed num_heads + 1")
        if self.windows not in ("stream", "document"):
            raise ValueError(f"windows must be 'stream' or 'document', got {self.windows!r}")
        if self.windows == "document" and self.max_doc_len > self.seq_len:
            raise ValueError(f"windows=document needs max_doc_len ({self.max_doc_len}) <= seq_len ({self.seq_len})")


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """``precision: auto`` -> 'bf16' where ``device`` runs bf16 matmuls natively, else 'fp32' (on a CPU without
    bf16 instructions a bf16 forward costs several fp32 ones); an explicit choice is kept. Returns (precision, why)."""
    from medusa_lite.machine import native_bf16

    if requested != "auto":
        return requested, "set in the config"
    native, why = native_bf16(device)
    return ("bf16" if native else "fp32"), why
