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
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from medusa_lite.train import data as D
from medusa_lite.machine import hardware_summary
from medusa_lite.paths import resolve_config
from medusa_lite.settings import Ints, SettingsParser, option
from medusa_lite.drafters.heads import num_positions
from medusa_lite.train.loss import agreement


# ================================================================================================ config
@dataclass
class TrainConfig:
    """Every training option, flat. Precedence: these defaults < the YAML file < command-line flags."""

    # target
    target: str | None = option(None, "HF directory or .gguf file; none: the bundled default target")
    adapter: str | None = option(None, "PEFT (LoRA) adapter directory, merged into the target")
    # heads
    head_type: str = option("medusa", "the registered drafter: medusa (heads read h_t only), hydra (heads also read "
                                      "the drafted path), eagle3 (one decoder layer over three target layers)")
    num_heads: int = option(4, "draft depth: heads, or eagle3's steps unrolled in training (training-time test)")
    num_layers: int = option(1, "ResBlocks per head (medusa, hydra)")
    share_lm_head: bool = option(True, "heads project with the frozen target lm_head (else one lm_head each)")
    aux_layers: Ints | None = option(None, "eagle3: the target hidden_states it reads (none: 2, L // 2, L - 3)")
    intermediate_size: int | None = option(None, "eagle3: its MLP width (none: the target's)")
    # data
    data: str = option("sharegpt", "'sharegpt' or a .json / .jsonl file (chat messages or {\"text\"}); several "
                                   "comma-separated, each optionally NAME[start:stop] of its seeded shuffle")
    max_samples: int | None = option(2000, "documents used for training, after a seeded shuffle (none: all)")
    eval_samples: int = option(50, "held-out documents (disjoint from training)")
    eval_data: str | None = option(None, "held-out documents from this .json / .jsonl file (the first eval_samples "
                                         "after the seeded shuffle; none: from data): a metric that stays comparable "
                                         "when data grows")
    max_doc_len: int = option(1024, "documents are truncated to this many tokens")
    seq_len: int = option(256, "training window length")
    num_proc: int | None = option(None, "datasets.map workers")
    # loss / optimisation
    loss: Literal["kl", "ce"] = option("kl", "kl: self-distillation to the target; ce: the data's tokens")
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
    deepspeed: str = option("zero2", "DeepSpeed JSON: a path or a shipped name (zero2, zero3)")
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

        for name, allowed in (("loss", ("kl", "ce")), ("head_type", tuple(sorted(DRAFTERS))),
                              ("precision", ("auto", "bf16", "fp32"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_heads", "num_layers", "seq_len", "max_steps", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab is not None and not self.share_lm_head:
            raise ValueError("draft_vocab needs share_lm_head=True (per-head lm_heads span the full vocabulary)")
        if self.head_type != "eagle3" and (self.aux_layers is not None or self.intermediate_size is not None):
            raise ValueError("aux_layers and intermediate_size shape an eagle3 drafter (head_type=eagle3)")
        if self.seq_len <= self.num_heads + 1:
            raise ValueError(f"seq_len={self.seq_len} must exceed num_heads + 1")


def settings_parser() -> SettingsParser:
    parser = SettingsParser(TrainConfig, prog="medusa-lite train", description=__doc__, kind="train")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return parser


def build_config(config: str | None, overrides: list[str]) -> TrainConfig:
    """Defaults < the YAML ``config`` (a path or a shipped name) < ``overrides`` (``key=value`` or flags)."""
    return settings_parser().parse((["--config", config] if config else []) + list(overrides))[0]


# ================================================================================================ runtime
@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device


_OWN_WORLD = {"made": False}  # this process made its own world of one (kept for later runs in the process)


def init_runtime(cfg: TrainConfig) -> Runtime:
    """DeepSpeed's process group: under a launcher from its environment; alone, a world of one (gloo on CPU)."""
    import deepspeed

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    # no launcher: a world of one. DeepSpeed reads these variables (LOCAL_RANK even after the init); a launcher
    # started later sets its own for its ranks, and the marker that this world is made up is not an env variable
    if "WORLD_SIZE" not in os.environ or _OWN_WORLD["made"]:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
        _OWN_WORLD["made"] = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu" and os.environ.get("MEDUSA_LITE_DS_SHM", "0") != "1":
        # DeepSpeed's CPU backend JIT-compiles a C++ shared-memory all-reduce on first use (minutes,
        # needs a compiler); plain gloo is plenty for the heads' gradients. MEDUSA_LITE_DS_SHM=1 keeps it.
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log0(rt: Runtime, *msg: Any) -> None:
    if rt.rank == 0:
        print(*msg, flush=True)


def leave(rt: Runtime) -> None:
    """End of a run. Launched ranks leave their process group (torn down at interpreter exit it can abort a
    rank); a world of one keeps it, since DeepSpeed holds on to it for the next run in this process."""
    barrier(rt)
    if not _OWN_WORLD["made"]:
        dist.destroy_process_group()


def barrier(rt: Runtime) -> None:
    if rt.world > 1:
        dist.barrier()


# ================================================================================================ build
def build_model(cfg: TrainConfig, rt: Runtime):
    """Frozen target + fresh heads (fp32 master weights). Returns (MedusaModel, tokenizer)."""
    from medusa_lite import MedusaModel
    from medusa_lite.drafters import config_class
    from medusa_lite.targets import DEFAULT_TARGET, load_target

    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    target, tokenizer = load_target(cfg.target, dtype=dtype, device=str(rt.device), adapter=cfg.adapter)
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


def _draft_vocab_size(cfg: TrainConfig, target) -> int | None:
    vocab = target.get_output_embeddings().weight.shape[0]
    return cfg.draft_vocab if cfg.draft_vocab is not None and cfg.draft_vocab < vocab else None


def build_data(cfg: TrainConfig, tokenizer, rt: Runtime) -> tuple[D.TokenData, D.TokenData, dict[str, Any]]:
    """(train, held-out) token streams and a summary of what was read."""
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
    summary = {"data": cfg.data, "path": ",".join(map(str, paths)), "eval_data": cfg.eval_data,
               "train_docs": train_data.num_docs,
               "train_tokens": int(train_data.ids.numel()), "train_loss_tokens": train_data.num_loss_tokens,
               "eval_docs": eval_data.num_docs if eval_data else 0,
               "eval_loss_tokens": eval_data.num_loss_tokens if eval_data else 0,
               "skipped_records": dict(skipped)}
    log0(rt, "data: " + json.dumps(summary))
    return train_data, eval_data, summary


def feature_layers(drafter) -> tuple[int, ...]:
    """The target hidden states training reads: the drafter's, then the final-norm states (the teacher's input)
    unless the drafter reads them already."""
    layers = tuple(drafter.hidden_layers)
    return layers if -1 in layers else layers + (-1,)


def split_features(features: torch.Tensor, drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., len(feature_layers) * H] -> (the drafter's features [..., F], the final-norm states [..., H])."""
    layers = feature_layers(drafter)
    h = features.shape[-1] // len(layers)
    final = layers.index(-1)
    return features[..., : len(drafter.hidden_layers) * h], features[..., final * h: (final + 1) * h]


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, layers: tuple[int, ...],
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] ids -> [B, T, len(layers) * H] the target's hidden states of ``layers``, concatenated."""
    from medusa_lite.drafters import drafter_features

    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                 return_dict=True, logits_to_keep=1)
    return drafter_features(out.hidden_states, layers)


@torch.no_grad()
def compute_features(target, data: D.TokenData, rt: Runtime, layers: tuple[int, ...] = (-1,), *,
                     tokens_per_batch: int = 4096, desc: str = "features", progress: bool = True,
                     known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Hidden states of ``layers`` [N, len(layers) * H] (bf16) of every document, each run with its own full context.

    Documents are length-bucketed (sorted) into batches of about ``tokens_per_batch`` tokens; with
    several ranks each computes a share and the shares are all-gathered. ``known``: features of documents
    computed before (document index -> [n, F], :func:`reusable_features`), copied instead of computed.
    """
    from tqdm import tqdm

    slices = data.doc_slices()
    known = known or {}
    mine = [d for d in range(len(slices)) if d not in known][rt.rank::rt.world]
    mine.sort(key=lambda i: slices[i][1] - slices[i][0])
    hidden = torch.zeros(int(data.ids.numel()), len(layers) * target.config.get_text_config().hidden_size,
                         dtype=torch.bfloat16)
    bar = tqdm(total=sum(slices[i][1] - slices[i][0] for i in mine), desc=desc, unit="tok",
               disable=not (progress and rt.rank == 0), mininterval=5)
    i = 0
    while i < len(mine):
        longest = slices[mine[i]][1] - slices[mine[i]][0]
        batch = [mine[i]]
        i += 1
        while i < len(mine):
            length = slices[mine[i]][1] - slices[mine[i]][0]
            if length * (len(batch) + 1) > tokens_per_batch:
                break
            batch.append(mine[i])
            longest = length
            i += 1
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, d in enumerate(batch):
            s, e = slices[d]
            ids[row, : e - s] = data.ids[s:e]
            mask[row, : e - s] = 1
        h = target_features(target, ids.to(rt.device), layers, mask.to(rt.device)).to("cpu", torch.bfloat16)
        for row, d in enumerate(batch):
            s, e = slices[d]
            hidden[s:e] = h[row, : e - s]
        bar.update(int(mask.sum()))
    bar.close()
    if rt.world > 1:  # every rank computed distinct documents (rows of others are zero): sum = union
        gathered = hidden.float()
        dist.all_reduce(gathered)
        hidden = gathered.to(torch.bfloat16)
    for d, features in known.items():
        s, e = slices[d]
        hidden[s:e] = features
    return hidden


def document_key(ids: torch.Tensor) -> bytes:
    """A document's identity for the feature cache: its token ids."""
    return ids.to(torch.int64).numpy().tobytes()


def reusable_features(state: dict[str, torch.Tensor], data: D.TokenData) -> dict[int, torch.Tensor]:
    """Document index in ``data`` -> its features [n, F] in a feature cache file (:func:`cached_features`), for the
    documents the file holds."""
    if "segments" not in state:  # written before the cache kept document bounds: nothing to match by
        return {}
    stored = {document_key(state["ids"][s:e]): state["hidden"][s:e] for s, e in D.segment_slices(state["segments"])}
    found = ((d, stored.get(document_key(data.ids[s:e]))) for d, (s, e) in enumerate(data.doc_slices()))
    return {d: features for d, features in found if features is not None}


def cached_features(cfg: TrainConfig, model, data: D.TokenData, rt: Runtime, name: str) -> torch.Tensor:
    """:func:`compute_features` of the layers training reads, stored in ``output_dir/features`` so a resumed run
    reuses them."""
    from safetensors.torch import load_file, save_file

    layers = torch.tensor(feature_layers(model.drafter))
    path = Path(cfg.output_dir) / "features" / f"{name}.safetensors"
    known = {}
    if path.is_file():
        state = load_file(str(path))
        if torch.equal(state.get("layers", torch.tensor([-1])), layers):
            if torch.equal(state["ids"], data.ids):
                log0(rt, f"features: reusing {path}")
                return state["hidden"]
            known = reusable_features(state, data)  # the data changed (e.g. grew): keep the documents it still holds
        del state
    t0 = time.time()
    hidden = compute_features(model.base_model, data, rt, tuple(layers.tolist()), desc=f"features[{name}]",
                              progress=cfg.progress, known=known)
    log0(rt, f"features[{name}]: {hidden.shape[0]} tokens in {time.time() - t0:.0f}s"
             + (f", {len(known)} of {data.num_docs} documents reused from {path}" if known else ""))
    del known
    if rt.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"hidden": hidden.contiguous(), "ids": data.ids, "segments": data.segments, "layers": layers},
                  str(tmp))
        tmp.replace(path)  # an interrupted write leaves the previous cache, never half a file
    barrier(rt)
    return hidden


def load_deepspeed_config(cfg: TrainConfig, rt: Runtime) -> dict[str, Any]:
    """The DeepSpeed JSON with batch size, precision and clipping injected from the training config."""
    ds = json.loads(resolve_config("deepspeed", cfg.deepspeed).read_text())
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.micro_batch_size * cfg.grad_accum * rt.world
    ds["gradient_clipping"] = cfg.grad_clip
    # bf16 master/compute on CUDA; on CPU the heads stay fp32 and matmuls run under bf16 autocast
    ds["bf16"] = {"enabled": cfg.precision == "bf16" and rt.device.type == "cuda"}
    ds["fp16"] = {"enabled": False}
    ds.setdefault("steps_per_print", 10**9)
    ds["zero_allow_untested_optimizer"] = True
    return ds


def choose_draft_vocabulary(cfg: TrainConfig, model, data: D.TokenData) -> None:
    """A fresh run's draft vocabulary: the ``draft_vocab`` most frequent trained tokens, stored in the heads
    (``draft_ids``: decoding proposes from the same rows); the drafter's lm_head starts from their target rows.
    A resumed run keeps its checkpoint's (:func:`run`)."""
    if model.config.draft_vocab_size is None:
        return
    keep = trained_token_counts(model, data).topk(cfg.draft_vocab).indices.sort().values  # [V']
    model.drafter.draft_ids.copy_(keep.to(model.drafter.draft_ids.device))
    model.drafter.vocabulary_changed()


def trained_token_counts(model, data: D.TokenData) -> torch.Tensor:
    """[V] how often each target token is trained on."""
    vocab = model.base_model.get_output_embeddings().weight.shape[0]
    return torch.bincount(data.ids[data.mask.bool()], minlength=vocab)


def training_projection(model, data: D.TokenData) -> torch.nn.Module:
    """The vocabulary projection used in training: the target's lm_head, or its frozen [V', H] rows for the
    drafter's ``draft_ids`` (teacher and drafter both use it), with ``coverage``: their share of trained tokens."""
    lm_head = model.base_model.get_output_embeddings()
    if model.config.draft_vocab_size is None:
        return lm_head
    keep = model.drafter.draft_ids.to(lm_head.weight.device)
    proj = torch.nn.Linear(lm_head.weight.shape[1], len(keep), bias=lm_head.bias is not None,
                           device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    with torch.no_grad():
        proj.weight.copy_(lm_head.weight[keep])
        if lm_head.bias is not None:
            proj.bias.copy_(lm_head.bias[keep])
    proj.requires_grad_(False)
    counts = trained_token_counts(model, data)
    proj.coverage = float(counts[keep.cpu()].sum() / counts.sum().clamp(min=1))
    return proj


def lr_lambda(cfg: TrainConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return fn


class Engine:
    """The heads' optimiser, scheduler, accumulation, clipping and checkpoints: DeepSpeed (ZeRO-2/3) owns them
    all, on one CPU process as on many GPUs."""

    def __init__(self, cfg: TrainConfig, drafter: torch.nn.Module, rt: Runtime):
        import deepspeed

        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.rt = rt
        self.ds_config = load_deepspeed_config(cfg, rt)
        self.module, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=drafter, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
        self.drafter = drafter

    @property
    def zero_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)

    def step(self) -> None:
        """After every micro step: DeepSpeed steps the optimiser at accumulation boundaries."""
        self.module.step()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save_checkpoint(self, directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> None:
        """DeepSpeed's checkpoint of this step; only the newest ``keep`` are kept (0: all)."""
        self.module.save_checkpoint(str(directory), tag=f"step{step}", client_state=state)
        if keep and self.rt.rank == 0:
            import shutil

            tags = sorted((p for p in directory.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                          key=lambda p: int(p.name[4:]))
            for old in tags[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier(self.rt)

    def load_checkpoint(self, directory: Path) -> dict[str, Any] | None:
        """The client state of the latest checkpoint in ``directory`` (weights, optimiser and scheduler restored),
        or None when there is none."""
        if not (directory / "latest").is_file():
            return None
        path, state = self.module.load_checkpoint(str(directory))
        return state if path is not None else None

    def gathered(self):
        """Context in which the full head parameters are materialised (ZeRO-3 partitions them)."""
        import contextlib

        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.drafter.parameters()), modifier_rank=None)
        return contextlib.nullcontext()


# ================================================================================================ run
class Batches:
    """Deterministic window order: epoch e is a permutation seeded by (seed, e); global step s of an
    epoch takes the next ``micro * accum * world`` windows, rank r its own slice of each micro step.
    Resuming at step s therefore replays exactly the order of an uninterrupted run."""

    def __init__(self, starts: torch.Tensor, cfg: TrainConfig, rt: Runtime):
        self.starts, self.cfg, self.rt = starts, cfg, rt
        self.global_batch = cfg.micro_batch_size * cfg.grad_accum * rt.world
        self.steps_per_epoch = len(starts) // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"{len(starts)} training windows < one global batch of {self.global_batch}; "
                             "add data or lower micro_batch_size / seq_len")

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """Window starts of this rank's ``grad_accum`` micro batches for optimiser step ``step``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(len(self.starts), generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))
        base = index * self.global_batch
        mb = self.cfg.micro_batch_size
        out = []
        for a in range(self.cfg.grad_accum):
            lo = base + (a * self.rt.world + self.rt.rank) * mb
            out.append(self.starts[perm[lo: lo + mb]])
        return out


def window_inputs(cfg: TrainConfig, model, proj, data: D.TokenData, hidden: torch.Tensor | None,
                  starts: torch.Tensor, rt: Runtime) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafter features [B, T, F], teacher logits [B, T, V'], weights [K, B, T], ids [B, T], segments [B, T])
    for windows at ``starts``."""
    ids = D.gather_windows(data.ids, starts, cfg.seq_len).to(rt.device)           # [B, T]
    segments = D.gather_windows(data.segments, starts, cfg.seq_len).to(rt.device)  # [B, T] document index
    weights = D.window_weights(data.mask, data.segments, starts, seq_len=cfg.seq_len, num_heads=cfg.num_heads,
                               total=int(data.ids.numel())).to(rt.device)         # [K, B, T]
    lm_head = model.base_model.get_output_embeddings()
    with torch.no_grad(), autocast(cfg, rt):
        if hidden is not None:
            h, final = split_features(D.gather_windows(hidden, starts, cfg.seq_len).to(rt.device), model.drafter)
            teacher = proj(final.to(proj.weight.dtype))                            # [B, T, V'] from the cache
        else:  # the target forward: its hidden states feed the drafter, its logits are the teacher
            from medusa_lite.drafters import drafter_features

            out = model.base_model(input_ids=ids, output_hidden_states=True, return_dict=True)
            h = drafter_features(out.hidden_states, model.drafter.hidden_layers)
            teacher = out.logits if proj is lm_head else proj(out.hidden_states[-1])
    return h, teacher, weights, ids, segments


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """``precision: auto`` -> 'bf16' where ``device`` runs bf16 matmuls natively, else 'fp32' (on a CPU without
    bf16 instructions a bf16 forward costs several fp32 ones); an explicit choice is kept. Returns (precision, why)."""
    from medusa_lite.machine import native_bf16

    if requested != "auto":
        return requested, "set in the config"
    native, why = native_bf16(device)
    return ("bf16" if native else "fp32"), why


def autocast(cfg: TrainConfig, rt: Runtime):
    return torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def train_step(cfg: TrainConfig, model, proj, engine: Engine, data: D.TokenData, hidden, micro_batches,
               rt: Runtime):
    """One optimiser step over this rank's micro batches; returns summed per-head stats."""
    stats = None
    for starts in micro_batches:
        h, teacher, weights, ids, segments = window_inputs(cfg, model, proj, data, hidden, starts, rt)
        with autocast(cfg, rt):
            head_logits = engine(h.float() if cfg.precision == "fp32" else h, ids, segments)  # [K, B, T, V']
        loss, s = model.drafter.loss(head_logits, teacher, weights, ids, loss=cfg.loss, decay=cfg.decay)
        engine.backward(loss)
        engine.step()
        s = {k: v.detach().float() * (s["count"] if k == "loss" else 1) for k, v in s.items()}
        stats = s if stats is None else {k: stats[k] + s[k] for k in s}
    if rt.world > 1:
        for v in stats.values():
            dist.all_reduce(v)
    return stats


@torch.no_grad()
def evaluate(cfg: TrainConfig, model, engine: Engine, data: D.TokenData, hidden, rt: Runtime) -> dict[str, Any]:
    """Per-head top-1 / top-5 agreement with the target's argmax on the held-out windows, the heads
    proposing from the vocabulary they decode with (``draft_ids`` when set)."""
    starts = D.make_windows(data, seq_len=cfg.seq_len, num_heads=cfg.num_heads)
    mine = starts[rt.rank::rt.world]
    hits = {1: torch.zeros(cfg.num_heads), 5: torch.zeros(cfg.num_heads)}
    count = torch.zeros(cfg.num_heads)
    lm_head = model.base_model.get_output_embeddings()
    vocab_ids = getattr(model.drafter, "draft_ids", None)
    n = num_positions(cfg.seq_len, cfg.num_heads)
    with engine.gathered():
        for i in range(0, len(mine), cfg.micro_batch_size):
            h, teacher, weights, ids, segments = window_inputs(cfg, model, lm_head, data, hidden,
                                                               mine[i: i + cfg.micro_batch_size], rt)
            with autocast(cfg, rt):
                head_logits = model.drafter(h.float() if cfg.precision == "fp32" else h, ids, segments)  # [K, B, T, V']
            got = agreement(head_logits.float(), teacher.float(), weights.cpu(), topk=(1, 5), vocab_ids=vocab_ids)
            for k in hits:
                hits[k] += got[k]
            count += weights[:, :, :n].sum((1, 2)).cpu()
    if rt.world > 1:
        for t in (*hits.values(), count):
            dist.all_reduce(t)
    c = count.clamp(min=1)
    return {"eval_positions": int(count[0]), "top1": [round(float(x), 4) for x in hits[1] / c],
            "top5": [round(float(x), 4) for x in hits[5] / c]}


def run(cfg: TrainConfig, model, engine: Engine, train_data, train_hidden, rt: Runtime) -> dict[str, Any]:
    """The training loop with resume, checkpoints, JSONL log and progress bar; returns run statistics."""
    from tqdm import tqdm

    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    chosen = getattr(model.drafter, "draft_ids", None)
    chosen = None if chosen is None else chosen.clone()
    state = engine.load_checkpoint(ckpt_dir) if cfg.resume else None
    step = int(state["step"]) if state else 0
    tokens = int(state["tokens"]) if state else 0
    elapsed = float(state["train_seconds"]) if state else 0.0
    if state:
        log0(rt, f"resumed from {ckpt_dir} at step {step}")
    proj = training_projection(model, train_data)  # after the checkpoint: its draft_ids are what the drafter knows
    if chosen is not None and not torch.equal(chosen, model.drafter.draft_ids):
        changed = len(set(chosen.tolist()) - set(model.drafter.draft_ids.tolist()))
        log0(rt, f"resume: keeping the checkpoint's draft vocabulary ({changed} of its {chosen.numel()} tokens are not "
                 f"among this data's most frequent; they cover {proj.coverage:.4f} of its trained tokens)")
    elif proj is not model.base_model.get_output_embeddings():
        log0(rt, f"draft vocabulary: {proj.out_features} tokens cover {proj.coverage:.4f} of trained tokens")
    batches = Batches(D.make_windows(train_data, seq_len=cfg.seq_len, num_heads=cfg.num_heads), cfg, rt)
    stop = cfg.max_steps if cfg.max_steps_this_run is None else min(cfg.max_steps, step + cfg.max_steps_this_run)
    log_file = (out / "train_log.jsonl").open("a") if rt.rank == 0 else None
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step",
               disable=not (cfg.progress and rt.rank == 0), mininterval=5)
    positions_per_step = batches.global_batch * num_positions(cfg.seq_len, cfg.num_heads)
    window_stats, window_t0, window_steps = None, time.time(), 0
    t_start = time.time()
    timed_out = False
    while step < stop:
        stats = train_step(cfg, model, proj, engine, train_data, train_hidden, batches.micro_batches(step), rt)
        step += 1
        tokens += int(stats["count"][0])
        window_stats = stats if window_stats is None else {k: window_stats[k] + stats[k] for k in stats}
        window_steps += 1
        bar.update(1)
        timed_out = cfg.time_limit_minutes is not None and \
            elapsed + time.time() - t_start > 60 * cfg.time_limit_minutes
        if step % cfg.log_every == 0 or step == stop or timed_out:
            dt = time.time() - window_t0
            c = window_stats["count"].clamp(min=1)
            record = {"step": step, "epoch": round(step / batches.steps_per_epoch, 3),
                      "loss": [round(float(x), 4) for x in window_stats["loss"] / c],
                      "top1": [round(float(x), 4) for x in window_stats["top1"] / c],
                      "lr": engine.lr(), "tokens": tokens,
                      "positions_per_s": round(window_steps * positions_per_step / dt, 1),
                      "loss_tokens_per_s": round(float(window_stats["count"][0]) / dt, 1)}
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            bar.set_postfix(loss=record["loss"][0], top1=record["top1"][0])
            window_stats, window_t0, window_steps = None, time.time(), 0
        if (cfg.save_every and step % cfg.save_every == 0) or step == stop or timed_out:
            engine.save_checkpoint(ckpt_dir, step, {"step": step, "tokens": tokens,
                                                    "train_seconds": elapsed + time.time() - t_start},
                                   keep=cfg.keep_checkpoints)
        if timed_out:
            log0(rt, f"time limit of {cfg.time_limit_minutes} min reached at step {step}")
            break
    bar.close()
    if log_file:
        log_file.close()
    finished = step >= cfg.max_steps or timed_out
    this_run = time.time() - t_start
    return {"step": step, "tokens": tokens, "train_seconds": elapsed + this_run, "this_run_seconds": this_run,
            "this_run_steps": step - (int(state["step"]) if state else 0),
            "positions_per_step": positions_per_step, "finished": finished,
            "draft_vocab_coverage": getattr(proj, "coverage", None)}


# ================================================================================================ save
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


def model_card(p: dict[str, Any]) -> str:
    """The heads directory's README.md, rendered from the provenance stored in ``MedusaConfig.training``."""
    ev, cfg, data = p.get("eval", {}), p.get("config", {}), p["data"]
    rows = "\n".join(f"| {k + 1} | {ev['top1'][k]:.3f} | {ev['top5'][k]:.3f} |" for k in range(len(ev.get("top1", []))))
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

| head | top-1 | top-5 |
|---:|---:|---:|
{rows}

The full training config is `training.config` in `medusa_config.json`.
"""


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
    log0(rt, "config: " + json.dumps(dataclasses.asdict(cfg)))
    # --- build
    model, tokenizer = build_model(cfg, rt)
    train_data, eval_data, data_summary = build_data(cfg, tokenizer, rt)
    train_hidden = cached_features(cfg, model, train_data, rt, "train") if cfg.cache_features else None
    eval_hidden = cached_features(cfg, model, eval_data, rt, "eval") \
        if cfg.cache_features and eval_data else None
    choose_draft_vocabulary(cfg, model, train_data)
    engine = Engine(cfg, model.drafter, rt)
    # --- run
    stats = run(cfg, model, engine, train_data, train_hidden, rt)
    if not stats["finished"]:
        log0(rt, f"stopped at step {stats['step']} of {cfg.max_steps} (max_steps_this_run); resume to finish")
        leave(rt)
        return {"stats": stats}
    # --- save
    metrics = evaluate(cfg, model, engine, eval_data, eval_hidden, rt) if eval_data else {}
    log0(rt, "eval: " + json.dumps(metrics))
    provenance = {
        "base_model": model.config.base_model, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
        "library_version": model.config.library_version, "loss": cfg.loss, "data": data_summary,
        "tokens_seen": stats["tokens"], "steps": stats["step"], "seq_len": cfg.seq_len,
        "global_batch_windows": cfg.micro_batch_size * cfg.grad_accum * rt.world,
        "train_seconds": round(stats["train_seconds"], 1), "wall_seconds": round(time.time() - t0, 1),
        "positions_per_s": stats["this_run_steps"] * stats["positions_per_step"] / max(stats["this_run_seconds"], 1e-9),
        "hardware": hardware_summary(), "world_size": rt.world,
        "engine": f"deepspeed ZeRO-{engine.zero_stage}",
        "command": launch_command(rt, argv), "draft_vocab_coverage": stats["draft_vocab_coverage"],
        "eval": metrics, "config": dataclasses.asdict(cfg),
    }
    heads_dir = save_heads(cfg, model, engine, rt, provenance)
    log0(rt, f"saved heads to {heads_dir}")
    leave(rt)
    return {"stats": stats, "eval": metrics, "heads_dir": str(heads_dir)}


if __name__ == "__main__":
    main()
