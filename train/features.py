"""The target's hidden states training reads, computed once per document and cached under ``output_dir/features``
(reused by a resumed run, and document by document when the data grows)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from medusa_lite.drafters import drafter_features
from medusa_lite.train import data as D

from .config import TrainConfig
from .runtime import Runtime, all_reduce_host, barrier, log0


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
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                 return_dict=True, logits_to_keep=1)
    return drafter_features(out.hidden_states, layers)


def length_batches(slices: list[tuple[int, int]], docs: list[int], tokens_per_batch: int) -> list[list[int]]:
    """``docs`` (indices into ``slices``) sorted by length and cut into batches of about ``tokens_per_batch`` padded
    tokens (a document longer than that is a batch of its own)."""
    docs = sorted(docs, key=lambda d: slices[d][1] - slices[d][0])
    batches: list[list[int]] = []
    for d in docs:
        length = slices[d][1] - slices[d][0]  # the longest so far: the batch pads to it
        if batches and length * (len(batches[-1]) + 1) <= tokens_per_batch:
            batches[-1].append(d)
        else:
            batches.append([d])
    return batches


@torch.no_grad()
def compute_features(target, data: D.TokenData, rt: Runtime, layers: tuple[int, ...] = (-1,), *,
                     tokens_per_batch: int = 4096, desc: str = "features", progress: bool = True,
                     known: dict[int, torch.Tensor] | None = None, lockstep: bool = False) -> torch.Tensor:
    """Hidden states of ``layers`` [N, len(layers) * H] (bf16) of every document, each run with its own full context.

    Documents are length-bucketed (sorted) into batches of about ``tokens_per_batch`` tokens; with
    several ranks each computes a share and the shares are all-gathered. ``known``: features of documents
    computed before (document index -> [n, F], :func:`reusable_features`), copied instead of computed.
    ``lockstep``: every rank runs as many forwards (a rank out of documents runs one token), as a target whose
    layers are partitioned across the ranks needs (each forward gathers them: :mod:`medusa_lite.train.shard`).
    """
    from tqdm import tqdm

    slices = data.doc_slices()
    known = known or {}
    todo = [d for d in range(len(slices)) if d not in known]
    batches = length_batches(slices, todo[rt.rank::rt.world], tokens_per_batch)
    rounds = max(len(length_batches(slices, todo[r::rt.world], tokens_per_batch)) for r in range(rt.world)) \
        if lockstep else len(batches)
    hidden = torch.zeros(int(data.ids.numel()), len(layers) * target.config.get_text_config().hidden_size,
                         dtype=torch.bfloat16)
    bar = tqdm(total=sum(slices[d][1] - slices[d][0] for batch in batches for d in batch), desc=desc, unit="tok",
               disable=not (progress and rt.rank == 0), mininterval=5)
    for i in range(rounds):
        if i >= len(batches):
            target_features(target, data.ids[:1][None].to(rt.device), layers)
            continue
        batch = batches[i]
        longest = max(slices[d][1] - slices[d][0] for d in batch)
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
        all_reduce_host(gathered, rt)
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
                              progress=cfg.progress, known=known, lockstep=cfg.shard_target)
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
