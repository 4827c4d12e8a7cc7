"""The number that decides speed, measured while training: the acceptance length the drafter reaches in medusa_lite's
own verify loop on held-out prompts, and the best-by-acceptance drafter the run keeps.

Acceptance length is new tokens per verify step (accepted + 1), pooled over ``accept_prompts`` held-out prompts of
``accept_tokens`` new tokens each: greedy, one fixed tree (``accept_tree``, else the heads' stored tree), no
prompt-lookup branch and no hardware fit (the fit probes the machine; its tree changes with the machine, not with
the drafter). The tree is written to ``output_dir/accept_tree.json``: ``medusa-lite bench --tree`` that file decodes
with the same one. The drafter decodes as a saved one loads: a copy
of its weights in the target's dtype, on the frozen target (:func:`decoding_model`). ``bench`` counts the prefill as
a forward as well; over 256 tokens that lowers its tokens per forward by under 1% of this figure.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from medusa_lite._hf import context_length
from medusa_lite.train import data as D

from .config import TrainConfig
from .engine import Engine
from .runtime import Runtime, barrier, log0


def held_out_prompts(tokenizer, records: list[dict], count: int, max_len: int) -> list[torch.Tensor]:
    """The prompt part [L] of the first ``count`` held-out records that have one, tokenized as training reads them
    (:func:`~medusa_lite.train.data.encode_record`): every token before the first trained one (a chat's turns up to
    its first answer with the generation prompt; a text's ``prompt_chars``); a text learnt in full gives its first
    half."""
    prompts = []
    for record in records:
        if len(prompts) == count:
            break
        enc = D.encode_record(tokenizer, record, max_len)
        ids, mask = enc["input_ids"], enc["loss_mask"]
        start = mask.index(1) if 1 in mask else 0  # (no trained token within max_len: no prompt either)
        if start == 0 and not record["messages"] and not record.get("prompt_chars"):
            start = len(ids) // 2
        if start >= 2:
            prompts.append(torch.tensor(ids[:start], dtype=torch.long))
    return prompts


def fixed_tree(cfg: TrainConfig, config):
    """The tree acceptance is measured with (JSON form): ``accept_tree`` or the heads' stored greedy tree, without a
    prompt-lookup branch (it copies from the prompt, which says nothing of the drafter)."""
    from medusa_lite.tree import WithLookup, load_tree, parse_tree, tree_json

    tree = load_tree(cfg.accept_tree) if cfg.accept_tree else parse_tree(config.choices_for(False), config.num_heads)
    return tree_json(tree.tree if isinstance(tree, WithLookup) else tree)


def write_tree(cfg: TrainConfig, config, rt: Runtime) -> None:
    """``output_dir/accept_tree.json``: the tree acceptance is measured with, for ``medusa-lite bench --tree``."""
    if rt.rank == 0:
        (Path(cfg.output_dir) / "accept_tree.json").write_text(json.dumps(fixed_tree(cfg, config)) + "\n")


def decoding_model(model, engine: Engine, rt: Runtime):
    """On rank 0: a MedusaModel on the frozen target with a copy of the drafter's current weights in the target's
    dtype, as ``MedusaModel.from_pretrained`` makes it from the saved heads; None on other ranks. Every rank calls it
    (gathering ZeRO-3 partitioned heads is collective)."""
    from medusa_lite import MedusaModel

    with engine.gathered():
        state = {k: v.detach().clone() for k, v in model.drafter.state_dict().items()} if rt.rank == 0 else None
    if state is None:
        return None
    decoder = MedusaModel(model.base_model, copy.deepcopy(model.config))
    decoder.drafter.load_state_dict(state)
    decoder.drafter.eval()
    return decoder


def acceptance_length(cfg: TrainConfig, model, engine: Engine, prompts: list[torch.Tensor], rt: Runtime,
                      shard=None) -> dict[str, Any]:
    """``accept_length`` (tokens per verify step) and how it was measured; {} without prompts. Rank 0 decodes; with a
    sharded target (``shard``: :class:`~medusa_lite.train.shard.ShardedTarget`) the other ranks lend it their shards
    of each layer it runs."""
    if not prompts:
        return {}
    tree = fixed_tree(cfg, model.config)
    decoder = decoding_model(model, engine, rt)
    room = context_length(model.base_model.config)

    def decode() -> torch.Tensor:
        tokens = steps = 0
        t0 = time.perf_counter()
        for prompt in prompts:
            prompt = prompt[-(room - cfg.accept_tokens):] if room else prompt  # its end within the context length
            decoder.generate(prompt[None].to(rt.device), max_new_tokens=cfg.accept_tokens, do_sample=False,
                             tree=tree, fit=False)
            tokens += sum(decoder.last_stats.tokens_per_step)
            steps += decoder.last_stats.verify_steps
        return torch.tensor([tokens, steps, time.perf_counter() - t0], dtype=torch.float64)

    result = shard.lead(decode) if shard is not None else (decode() if rt.rank == 0 else None)
    if rt.world > 1:  # rank 0's numbers, for every rank
        result = (result if result is not None else torch.zeros(3, dtype=torch.float64)).to(rt.device)
        dist.broadcast(result, src=0)
    tokens, steps, seconds = result.tolist()
    return {"accept_length": round(tokens / max(steps, 1), 4), "accept_steps": int(steps),
            "accept_prompts": len(prompts), "accept_tokens": cfg.accept_tokens, "accept_tree": tree,
            "accept_dtype": str(decoder_dtype(model)), "accept_seconds": round(seconds, 2)}


def decoder_dtype(model) -> torch.dtype:
    """The dtype the heads decode in: the target's (a saved drafter loads in it)."""
    return model.base_model.get_output_embeddings().weight.dtype


class BestHeads:
    """The best evaluation by acceptance length (the later of equals) and its drafter weights, kept in
    ``output_dir/best``: what the run writes as its heads. ``record`` (step, accept_length, metrics) travels in the
    checkpoints' client state, so a resumed run knows it; the weights file names its step, so a file that a
    checkpoint does not know (written after it) is never taken for its best."""

    def __init__(self, cfg: TrainConfig, rt: Runtime):
        self.dir = Path(cfg.output_dir) / "best"
        self.rt = rt
        self.record: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []  # (step, accept_length, top-1 of head 1) of every evaluation

    def restore(self, state: dict[str, Any] | None) -> None:
        """A resumed run's best and history, from its checkpoint's client state."""
        if state:
            self.record, self.history = state.get("best"), list(state.get("eval_history", []))

    def state(self) -> dict[str, Any]:
        return {"best": self.record, "eval_history": self.history}

    def offer(self, step: int, metrics: dict[str, Any], model, engine: Engine) -> bool:
        """Keep ``metrics`` (of the drafter as it is at ``step``) if its acceptance length is the best so far."""
        length = metrics.get("accept_length")
        self.history = [h for h in self.history if h["step"] != step]  # (a resumed run may evaluate a step again)
        self.history.append({"step": step, "accept_length": length, "top1": (metrics.get("top1") or [None])[0]})
        if length is None or (self.record is not None and length < self.record["accept_length"]):
            return False
        from safetensors.torch import save_file

        with engine.gathered():
            if self.rt.rank == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                state = {k: v.detach().contiguous().cpu() for k, v in model.drafter.state_dict().items()}
                save_file(state, str(self.dir / f"step{step}.safetensors.tmp"))
                (self.dir / f"step{step}.safetensors.tmp").replace(self.dir / f"step{step}.safetensors")
                for old in self.dir.glob("step*.safetensors"):
                    if old.name != f"step{step}.safetensors":
                        old.unlink()
        barrier(self.rt)
        self.record = {"step": step, "accept_length": length, "metrics": metrics}
        return True

    def load_into(self, model, engine: Engine) -> dict[str, Any] | None:
        """Put the best drafter's weights into ``model`` (every rank); returns its record, or None when there is no
        best to go back to (none measured, or its file is gone)."""
        if self.record is None:
            return None
        path = self.dir / f"step{self.record['step']}.safetensors"
        if not path.is_file():
            log0(self.rt, f"best heads: {path} is missing; the run writes its final heads")
            return None
        from safetensors.torch import load_file

        state = load_file(str(path))
        with engine.gathered(modify=True), torch.no_grad():
            for name, tensor in model.drafter.state_dict().items():
                tensor.copy_(state[name])
        return self.record


def describe(metrics: dict[str, Any]) -> str:
    """One evaluation as a log line: acceptance length beside the per-head top-1."""
    if "accept_length" not in metrics:
        return f"top1 {metrics.get('top1')}"
    return (f"accept_length {metrics['accept_length']:.3f} tokens/step ({metrics['accept_prompts']} held-out prompts x "
            f"{metrics['accept_tokens']} tokens, greedy, tree {json.dumps(metrics['accept_tree'])[:60]}), "
            f"top1 {metrics.get('top1')}")
