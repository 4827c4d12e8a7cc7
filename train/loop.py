"""The training loop: the window order, one step's inputs and update, the held-out evaluation, the draft vocabulary,
and the run with resume, checkpoints, a JSONL log and a progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from medusa_lite.drafters import drafter_features, num_positions
from medusa_lite.train import data as D
from medusa_lite.train.loss import agreement, sampled_acceptance

from .acceptance import BestHeads, acceptance_length, describe, write_tree
from .config import TrainConfig
from .engine import Engine
from .features import split_features
from .runtime import Runtime, all_reduce_host, log0


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
                               total=int(data.ids.numel()),
                               whole_documents=cfg.windows == "document").to(rt.device)  # [K, B, T]
    lm_head = model.base_model.get_output_embeddings()
    with torch.no_grad(), autocast(cfg, rt):
        if hidden is not None:
            h, final = split_features(D.gather_windows(hidden, starts, cfg.seq_len).to(rt.device), model.drafter)
            teacher = proj(final.to(proj.weight.dtype))                            # [B, T, V'] from the cache
        else:  # the target forward: its hidden states feed the drafter, its logits are the teacher
            # with a draft vocabulary the teacher is its own rows of the lm_head: the decoder alone, no [B, T, V]
            target = model.base_model if proj is lm_head else model.base_model.get_decoder()
            out = target(input_ids=ids, output_hidden_states=True, return_dict=True)
            h = drafter_features(out.hidden_states, model.drafter.hidden_layers)
            teacher = out.logits if proj is lm_head else proj(out.hidden_states[-1])
    return h, teacher, weights, ids, segments


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
    proposing from the vocabulary they decode with (``draft_ids`` when set), and ``accept_t1``: the chance that
    sampling at T = 1 accepts the head's draw (:func:`~medusa_lite.train.loss.sampled_acceptance`)."""
    starts = D.make_windows(data, seq_len=cfg.seq_len, num_heads=cfg.num_heads,
                            whole_documents=cfg.windows == "document")
    mine = starts[rt.rank::rt.world]
    hits = {1: torch.zeros(cfg.num_heads), 5: torch.zeros(cfg.num_heads)}
    count, accepted = torch.zeros(cfg.num_heads), torch.zeros(cfg.num_heads)
    lm_head = model.base_model.get_output_embeddings()
    vocab_ids = getattr(model.drafter, "draft_ids", None)
    n, mb = num_positions(cfg.seq_len, cfg.num_heads), cfg.micro_batch_size
    # a sharded target's forward is collective: every rank runs as many as rank 0, the one with the most windows
    lockstep = cfg.shard_target and hidden is None
    with engine.gathered():
        for i in range(0, len(starts[0::rt.world]) if lockstep else len(mine), mb):
            if i >= len(mine):
                window_inputs(cfg, model, lm_head, data, hidden, starts[:1], rt)
                continue
            h, teacher, weights, ids, segments = window_inputs(cfg, model, lm_head, data, hidden, mine[i: i + mb], rt)
            with autocast(cfg, rt):
                head_logits = model.drafter(h.float() if cfg.precision == "fp32" else h, ids, segments)  # [K, B, T, V']
            got = agreement(head_logits.float(), teacher.float(), weights.cpu(), topk=(1, 5), vocab_ids=vocab_ids)
            for k in hits:
                hits[k] += got[k]
            accepted += sampled_acceptance(head_logits.float(), teacher.float(), weights.cpu(), vocab_ids)
            count += weights[:, :, :n].sum((1, 2)).cpu()
    for t in (*hits.values(), count, accepted):
        all_reduce_host(t, rt)
    c = count.clamp(min=1)
    return {"eval_positions": int(count[0]), "top1": [round(float(x), 4) for x in hits[1] / c],
            "top5": [round(float(x), 4) for x in hits[5] / c],
            "accept_t1": [round(float(x), 4) for x in accepted / c]}


class Evaluations:
    """The held-out evaluations of a run: per-head agreement (:func:`evaluate`) and the acceptance length in the
    real verify loop (:func:`~medusa_lite.train.acceptance.acceptance_length`), every ``eval_every`` steps and at the
    end; the best by acceptance length is kept (:class:`~medusa_lite.train.acceptance.BestHeads`) and is what the
    run writes (:meth:`result`)."""

    def __init__(self, cfg: TrainConfig, model, engine: Engine, data: D.TokenData, hidden, prompts, rt: Runtime,
                 shard=None):
        self.cfg, self.model, self.engine, self.data, self.hidden, self.rt = cfg, model, engine, data, hidden, rt
        self.prompts, self.shard = prompts, shard
        self.every = cfg.save_every if cfg.eval_every is None else cfg.eval_every
        self.best = BestHeads(cfg, rt)
        self.last: tuple[int, dict[str, Any]] | None = None
        if prompts:
            write_tree(cfg, model.config, rt)

    def due(self, step: int, final: bool) -> bool:
        return final or bool(self.every and step % self.every == 0)

    def __call__(self, step: int) -> dict[str, Any]:
        """Evaluate the drafter as it is at ``step``; keep it if it is the best so far."""
        metrics = evaluate(self.cfg, self.model, self.engine, self.data, self.hidden, self.rt)
        metrics |= acceptance_length(self.cfg, self.model, self.engine, self.prompts, self.rt, self.shard)
        kept = self.best.offer(step, metrics, self.model, self.engine)
        log0(self.rt, f"eval at step {step}: {describe(metrics)}" + (" (best so far)" if kept else ""))
        self.last = (step, metrics)
        return metrics

    def result(self, step: int) -> dict[str, Any]:
        """The metrics of the heads the run writes, loaded into the drafter: the best evaluation's by acceptance length
        (the final step's when none was measured), with the final step's as ``final`` when they differ."""
        final = self.last[1] if self.last is not None and self.last[0] == step else self(step)
        best = self.best.load_into(self.model, self.engine)
        if best is None or best["step"] == step:
            log0(self.rt, f"the heads written are the final step's ({step}): {describe(final)}")
            return {**final, "heads_step": step}
        log0(self.rt, f"the heads written are step {best['step']}'s, the best acceptance length of "
                      f"{len(self.best.history)} evaluations ({best['accept_length']:.3f} tokens/step; the final step "
                      f"{step}: {final.get('accept_length', 0):.3f})")
        return {**best["metrics"], "heads_step": best["step"], "final": {"step": step, **final}}


def run(cfg: TrainConfig, model, engine: Engine, train_data, train_hidden, rt: Runtime,
        evals: Evaluations | None = None) -> dict[str, Any]:
    """The training loop with resume, checkpoints, held-out evaluations (``evals``), JSONL log and progress bar;
    returns run statistics."""
    from tqdm import tqdm

    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    state, proj = _resume(cfg, model, engine, train_data, ckpt_dir, rt)
    if evals is not None:
        evals.best.restore(state)
    step = int(state["step"]) if state else 0
    tokens = int(state["tokens"]) if state else 0
    elapsed = float(state["train_seconds"]) if state else 0.0
    batches = Batches(D.make_windows(train_data, seq_len=cfg.seq_len, num_heads=cfg.num_heads,
                                     whole_documents=cfg.windows == "document"), cfg, rt)
    stop = cfg.max_steps if cfg.max_steps_this_run is None else min(cfg.max_steps, step + cfg.max_steps_this_run)
    log = TrainLog(out / "train_log.jsonl" if rt.rank == 0 else None,
                   batches.global_batch * num_positions(cfg.seq_len, cfg.num_heads))
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step",
               disable=not (cfg.progress and rt.rank == 0), mininterval=5)
    t_start = time.time()
    engine.clock.start(elapsed)
    timed_out = False
    while step < stop:
        stats = train_step(cfg, model, proj, engine, train_data, train_hidden, batches.micro_batches(step), rt)
        step += 1
        tokens += int(stats["count"][0])
        log.add(stats)
        bar.update(1)
        timed_out = engine.clock.fraction() > 1.0  # the same clock the learning rate decays by
        # before the checkpoint, so that it holds the best evaluation so far; not in the log's training throughput
        t_eval = time.time()
        metrics = evals(step) if evals is not None and evals.due(step, step >= cfg.max_steps or timed_out) else None
        log.t0 += time.time() - t_eval
        if step % cfg.log_every == 0 or step == stop or timed_out or metrics:
            record = log.write(step, round(step / batches.steps_per_epoch, 3), engine.lr(), tokens, metrics)
            bar.set_postfix(loss=record["loss"][0], top1=record["top1"][0])
        if (cfg.save_every and step % cfg.save_every == 0) or step == stop or timed_out:
            engine.save_checkpoint(ckpt_dir, step, {"step": step, "tokens": tokens,
                                                    "train_seconds": elapsed + time.time() - t_start,
                                                    **(evals.best.state() if evals is not None else {})},
                                   keep=cfg.keep_checkpoints)
        if timed_out:
            log0(rt, f"time limit of {cfg.time_limit_minutes} min reached at step {step}")
            break
    bar.close()
    log.close()
    this_run = time.time() - t_start
    return {"step": step, "tokens": tokens, "train_seconds": elapsed + this_run, "this_run_seconds": this_run,
            "this_run_steps": step - (int(state["step"]) if state else 0),
            "positions_per_step": log.positions_per_step, "finished": step >= cfg.max_steps or timed_out,
            "draft_vocab_coverage": getattr(proj, "coverage", None)}


def _resume(cfg: TrainConfig, model, engine: Engine, train_data: D.TokenData, ckpt_dir: Path, rt: Runtime):
    """(the latest checkpoint's client state, None for a fresh run; the training projection). A resumed run keeps
    its checkpoint's draft vocabulary, loaded with the weights."""
    chosen = getattr(model.drafter, "draft_ids", None)
    chosen = None if chosen is None else chosen.clone()
    state = engine.load_checkpoint(ckpt_dir) if cfg.resume else None
    if state:
        log0(rt, f"resumed from {ckpt_dir} at step {int(state['step'])}")
    proj = training_projection(model, train_data)  # after the checkpoint: its draft_ids are what the drafter knows
    if chosen is not None and not torch.equal(chosen, model.drafter.draft_ids):
        changed = len(set(chosen.tolist()) - set(model.drafter.draft_ids.tolist()))
        log0(rt, f"resume: keeping the checkpoint's draft vocabulary ({changed} of its {chosen.numel()} tokens are not "
                 f"among this data's most frequent; they cover {proj.coverage:.4f} of its trained tokens)")
    elif proj is not model.base_model.get_output_embeddings():
        log0(rt, f"draft vocabulary: {proj.out_features} tokens cover {proj.coverage:.4f} of trained tokens")
    return state, proj


class TrainLog:
    """Per-head loss and top-1 agreement summed over the steps since the last record, written as JSON lines
    (``path`` None: another rank's, which writes nothing)."""

    def __init__(self, path: Path | None, positions_per_step: int):
        self.file = path.open("a") if path is not None else None
        self.positions_per_step = positions_per_step
        self.stats, self.t0, self.steps = None, time.time(), 0

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        self.stats = stats if self.stats is None else {k: self.stats[k] + stats[k] for k in stats}
        self.steps += 1

    def write(self, step: int, epoch: float, lr: float, tokens: int,
              metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """The record of the steps since the last one; ``metrics``: the held-out evaluation made at ``step``, beside
        the training top-1 (its ``eval`` field)."""
        dt = time.time() - self.t0
        c = self.stats["count"].clamp(min=1)
        record = {"step": step, "epoch": epoch,
                  "loss": [round(float(x), 4) for x in self.stats["loss"] / c],
                  "top1": [round(float(x), 4) for x in self.stats["top1"] / c],
                  "lr": lr, "tokens": tokens,
                  "positions_per_s": round(self.steps * self.positions_per_step / dt, 1),
                  "loss_tokens_per_s": round(float(self.stats["count"][0]) / dt, 1)}
        if metrics:
            record["eval"] = {k: v for k, v in metrics.items() if k in ("accept_length", "top1", "accept_t1")}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.stats, self.t0, self.steps = None, time.time(), 0
        return record

    def close(self) -> None:
        if self.file:
            self.file.close()
