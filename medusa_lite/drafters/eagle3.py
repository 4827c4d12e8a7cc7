"""An EAGLE-3 drafter (arXiv:2503.01840) attached to the frozen target.

It reads three of the target's hidden states (low, middle, high layers; ``aux_layers``, vLLM's
``eagle_aux_hidden_state_layer_ids``), fuses them with one linear layer (``fc``) and runs one decoder layer
of its own (``midlayer``: RoPE attention over its own KV cache, SwiGLU MLP, RMS norms) on
``[input_layernorm(e(x_{t+1})) ; hidden_norm(g_t)]``, then ``norm`` and its own ``lm_head`` over a reduced
draft vocabulary (``draft_ids``, vLLM's ``d2t``). Drafting deeper than one token feeds its own pre-norm output
back in place of the fused target state. Tensor names are vLLM's ``llama_eagle3.py`` names, so the export only
renames ``draft_ids``.

Positions: the drafter entry for target position p is computed from (g_p, e(x_{p+1})) at RoPE position p and
predicts x_{p+2}; a tree node at depth d >= 1 (its token x at position P + d, P the cache length) is expanded
from its parent's output at RoPE position P - 1 + d and sees the prefix entries, its ancestors' and its own.
Training unrolls the same K steps ("training-time test"): step k at window position t reads step k - 1's output,
the data token at t + 1 + k, and attends to step 0 at positions <= t and to steps 1..k at t only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .._hf import text_config
from ..config import DEFAULT_TREE
from ..tree import truncate
from .base import DraftState, PathDrafter
from .eagle3_layer import DecoderLayer
from .heads import heads_loss
from .registry import MedusaConfig, register_drafter


@dataclass
class Eagle3Config(MedusaConfig):
    """An EAGLE-3 drafter's shape. ``num_heads`` is the deepest draft (and the steps unrolled in training);
    ``None`` fields are filled from the target when the drafter is attached."""

    head_type: str = "eagle3"
    aux_layers: list[int] | None = None    # target hidden_states indices read (None: 2, L // 2, L - 3)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None

    def default_tree(self, sample: bool = False) -> list[list[int]] | dict:
        """Greedy: a tree grown each step (EAGLE-2), at most 4 deep (deeper levels are rarely accepted), growth
        stopping after a level whose best path probability is below 0.1. Sampling: the static default tree, whose
        tokens are drawn from the drafter, where a grown tree's are its top-k (deterministic proposals), which
        at T = 1 accepted 1.47 tokens per forward against 1.93 (docs/drafters.md)."""
        depth = min(4, self.num_heads)
        if sample:
            return truncate(DEFAULT_TREE, depth)
        return {"dynamic": {"nodes": 16, "depth": depth, "topk": 4, "expand": 4, "min_prob": 0.1}}


SETTLE_EVERY = 16  # committed positions a row's cache holds unread before a commit reads them in


@dataclass
class RowCache:
    """One row's drafter KV cache over the accepted prefix: keys, values [kv_heads, P, D]; the pre-norm output
    at the last prefix position (whose logits propose the depth-1 tokens). ``pending``: positions committed but
    not yet read in, (features [n, 3H], tokens [n]) per commit: steps that verify the root alone draft nothing,
    so their positions are read in together (one drafter forward) when the row next drafts, or every
    :data:`SETTLE_EVERY` positions."""

    keys: torch.Tensor
    values: torch.Tensor
    last: torch.Tensor
    pending: list = field(default_factory=list)

    @property
    def length(self) -> int:
        """Positions committed (read in or pending)."""
        return self.keys.shape[1] + sum(tokens.numel() for _, tokens in self.pending)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [M, heads, D], keys / values [kv_heads, S, D], allowed [M, S] bool -> [M, heads * D] (grouped heads)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=allowed[None],
                                         enable_gqa=True)          # [heads, M, D]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@register_drafter
class Eagle3Drafter(PathDrafter):
    name = "eagle3"
    config_class = Eagle3Config

    @classmethod
    def complete_config(cls, config: Eagle3Config, target_config) -> None:
        """Fill the shape fields left None from the target's (text) config."""
        cfg = text_config(target_config)
        layers = cfg.num_hidden_layers
        small = [min(1, layers - 1), layers // 2, layers - 1]  # tiny targets: still the inputs of three layers
        defaults = {"aux_layers": [2, layers // 2, layers - 3] if layers >= 6 else small,
                    "num_attention_heads": cfg.num_attention_heads,
                    "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                    "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                    "intermediate_size": getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
                    "rms_norm_eps": getattr(cfg, "rms_norm_eps", None) or 1e-6,
                    "rope_theta": _rope_theta(cfg)}
        for name, value in defaults.items():
            if getattr(config, name, None) is None:
                setattr(config, name, value)
        aux = config.aux_layers
        if len(aux) != 3 or list(aux) != sorted(aux) or not all(0 <= i < layers for i in aux):
            raise ValueError(f"aux_layers {aux}: three hidden_states indices in increasing order, each in [0, {layers}) "
                             "(the inputs of those target layers; vLLM collects them in that order)")

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layers) * h, h, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        vocab = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size, dtype=torch.long))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layers)

    def attach(self, target) -> None:
        super().attach(target)
        self.init_lm_head()

    def vocabulary_changed(self) -> None:
        self.init_lm_head()

    @torch.no_grad()
    def init_lm_head(self) -> None:
        """Start the draft lm_head as the target's rows for ``draft_ids`` (training's starting point; trained
        weights overwrite it on load)."""
        weight = self.target_lm_head.weight
        ids = getattr(self, "draft_ids", None)
        self.lm_head.weight.copy_(weight if ids is None else weight[ids.to(weight.device)])

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm.to(self.norm.weight.dtype)))

    # ------------------------------------------------------------------ training
    def forward(self, features: torch.Tensor, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Training-time test: features [B, T, 3H] (the aux layers), ids [B, T] -> logits [K, B, T, V'], step k at
        t scoring the token at t + 2 + k (the heads' convention, so :func:`heads_loss` applies). ``segments``
        [B, T] (document index of each position): attention stays inside a document, as in decoding."""
        cfg, layer = self.config, self.midlayer
        b, t, _ = features.shape
        hidden = self.fc(features.to(self.fc.weight.dtype))                 # [B, T, H]
        emb = self.target_embed(ids)                                        # [B, T, H]
        base = torch.arange(t, device=ids.device).expand(b, t)              # [B, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None, None]  # [1, 1, T, T]
        if segments is not None:
            causal = causal & (segments[:, None, :, None] == segments[:, None, None, :])   # [B, 1, T, T]
        scale = 1.0 / math.sqrt(cfg.head_dim)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        keys0 = values0 = None
        own_keys, own_values, out = [], [], []
        for k in range(cfg.num_heads):
            follow = torch.zeros_like(emb)
            follow[:, : t - 1 - k] = emb[:, 1 + k:]                         # the data token at t + 1 + k
            q, kk, v = layer.self_attn.qkv(layer.inputs(follow, hidden), base + k, cfg.rope_theta)  # [B, T, h, D]
            q = q.transpose(1, 2)                                           # [B, heads, T, D]
            kk = kk.transpose(1, 2).repeat_interleave(group, dim=1)         # [B, heads, T, D]
            v = v.transpose(1, 2).repeat_interleave(group, dim=1)
            if k == 0:
                keys0, values0 = kk, v
            else:
                own_keys.append(kk)
                own_values.append(v)
            scores = (q @ keys0.transpose(-1, -2)) * scale                  # [B, heads, T, T]
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
            diag = [((q * key).sum(-1) * scale)[..., None] for key in own_keys]  # each [B, heads, T, 1]
            probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            attn = probs[..., :t] @ values0                                 # [B, heads, T, D]
            for j, value in enumerate(own_values):
                attn = attn + probs[..., t + j: t + j + 1] * value
            attn = attn.transpose(1, 2).reshape(b, t, -1)                   # [B, T, heads * D]
            hidden = layer.finish(attn, hidden)                             # [B, T, H] pre-norm
            out.append(self.logits(hidden))
        return torch.stack(out)                                             # [K, B, T, V']

    def loss(self, logits, teacher, weights, ids, *, loss="kl", decay=0.8):
        return heads_loss(logits, teacher, weights, ids, loss=loss, decay=decay)

    @torch.no_grad()
    def ranked(self, hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        return self.token_ids(self(hidden[None], ids[None])[:, 0].topk(topk, dim=-1).indices)

    # ------------------------------------------------------------------ decoding
    def start(self, ids: list[torch.Tensor], hidden: torch.Tensor) -> DraftState:
        """Prefill the drafter's cache over each row's prompt (features [B, L, 3H], tokens after each position)."""
        state = super().start(ids, hidden)
        state.cache = self._extend_rows([None] * len(ids), [hidden[b, : row.numel() - 1] for b, row in enumerate(ids)],
                                        [row[1:] for row in ids])
        return state

    def commit(self, state: DraftState, accepted, hidden, ids) -> None:
        """Each row's accepted positions (their target features, the tokens after them) join its cache: pending,
        read in by the row's next draft (:meth:`settle_rows`) or once :data:`SETTLE_EVERY` are pending."""
        full = []
        for b, (nodes, row) in enumerate(zip(accepted, ids)):
            cache = state.cache[b]
            tokens = row[cache.length + 1: cache.length + 1 + nodes.numel()]
            cache.pending.append((hidden[b, nodes.to(hidden.device)], tokens))
            if cache.length - cache.keys.shape[1] >= SETTLE_EVERY:
                full.append(cache)
        self.settle_rows(full)
        super().commit(state, accepted, hidden, ids)

    def settle(self, cache: RowCache) -> RowCache:
        """Read a row's pending positions into its cache (in place: every view of the row sees it)."""
        self.settle_rows([cache])
        return cache

    def settle_rows(self, caches: list[RowCache]) -> None:
        """Read the rows' pending positions into their caches, in place, all rows in one drafter forward."""
        todo = list({id(cache): cache for cache in caches if cache.pending}.values())
        if not todo:
            return
        extended = self._extend_rows(todo, [torch.cat([f for f, _ in cache.pending]) for cache in todo],
                                     [torch.cat([t for _, t in cache.pending]) for cache in todo])
        for cache, new in zip(todo, extended):
            cache.keys, cache.values, cache.last, cache.pending = new.keys, new.values, new.last, []

    def _extend_rows(self, caches: list[RowCache | None], features: list[torch.Tensor],
                     tokens: list[torch.Tensor]) -> list[RowCache]:
        """Per row, entries for the next n_r positions after a read-in cache (None: an empty one): features [n_r, 3H]
        of the target there, tokens [n_r] that follow them. One pass over the weights for all rows."""
        cfg, layer = self.config, self.midlayer
        sizes = [t.numel() for t in tokens]
        device = tokens[0].device
        positions = torch.cat([torch.arange(start, start + n, device=device) for start, n in
                               zip([0 if c is None else c.keys.shape[1] for c in caches], sizes)])
        hidden = self.fc(torch.cat(features).to(self.fc.weight.dtype))      # [sum n, H]
        q, k, v = layer.self_attn.qkv(layer.inputs(self.target_embed(torch.cat(tokens)), hidden), positions,
                                      cfg.rope_theta)
        keys, values, outs = [], [], []
        for cache, q_r, k_r, v_r in zip(caches, q.split(sizes), k.split(sizes), v.split(sizes)):
            k_r, v_r = k_r.transpose(0, 1), v_r.transpose(0, 1)              # [kv_heads, n, D]
            if cache is not None:
                k_r, v_r = torch.cat([cache.keys, k_r], dim=1), torch.cat([cache.values, v_r], dim=1)
            allowed = torch.ones(1, k_r.shape[1], dtype=torch.bool, device=device)  # the last query sees all
            outs.append(_attend(q_r[-1:], k_r, v_r, allowed))                # only the last output is read
            keys.append(k_r)
            values.append(v_r)
        ends = torch.tensor(sizes, device=device).cumsum(0) - 1
        last = layer.finish(torch.cat(outs), hidden[ends])                   # [R, H]
        return [RowCache(k_r, v_r, last_r) for k_r, v_r, last_r in zip(keys, values, last)]

    def begin_rows(self, hidden, ids, caches):
        if any(cache is None for cache in caches):
            raise ValueError("an eagle3 drafter drafts from its own cache: build the state with start()")
        self.settle_rows(caches)
        return [{"cache": cache, "keys": [], "values": [], "entry": {}, "state": None} for cache in caches]

    def advance_rows(self, ctxs, requests):
        """Every row's level in one pass over the weights: the linears over all rows' nodes at once, attention per
        row (each over its own cache and drafted path)."""
        cfg, layer = self.config, self.midlayer
        deeper = [r for r, (depth, *_) in enumerate(requests) if depth > 0]
        for r, (depth, *_) in enumerate(requests):
            if depth == 0:  # the root's children come from the last prefix entry, which already read the root
                ctxs[r]["state"] = ctxs[r]["cache"].last[None]
        if deeper:
            sizes = [requests[r][2].numel() for r in deeper]
            parent_state = torch.cat([ctxs[r]["state"][requests[r][1]] for r in deeper])  # [sum M, H]
            device = parent_state.device
            positions = torch.cat([torch.full((m,), ctxs[r]["cache"].length - 1 + requests[r][0], device=device)
                                   for r, m in zip(deeper, sizes)])                  # a level's nodes: one position
            tokens = torch.cat([requests[r][2] for r in deeper])
            q, k, v = layer.self_attn.qkv(layer.inputs(self.target_embed(tokens), parent_state), positions,
                                          cfg.rope_theta)
            attn = [self._tree_attention(ctxs[r], requests[r][3], requests[r][4], *qkv)
                    for r, *qkv in zip(deeper, q.split(sizes), k.split(sizes), v.split(sizes))]
            for r, state in zip(deeper, layer.finish(torch.cat(attn), parent_state).split(sizes)):  # [M_r, H]
                ctxs[r]["state"] = state
        logits = self.logits(torch.cat([ctx["state"] for ctx in ctxs]))
        return list(logits.split([ctx["state"].shape[0] for ctx in ctxs]))

    @staticmethod
    def _tree_attention(ctx, nodes: list[int], parents: list[int], q, k, v) -> torch.Tensor:
        """One row's drafted nodes (q, k, v [M, heads or kv_heads, D]) attend to its cache and their own paths;
        their keys and values join the row's drafted entries. -> [M, heads * D]"""
        cache: RowCache = ctx["cache"]
        m, entries = len(nodes), len(ctx["entry"])
        allowed = torch.zeros(m, cache.length + entries + m, dtype=torch.bool, device=q.device)
        allowed[:, : cache.length] = True
        for i, node in enumerate(nodes):
            ancestor = parents[node]
            while ancestor > 0:  # the root's entry is the prefix's last
                allowed[i, cache.length + ctx["entry"][ancestor]] = True
                ancestor = parents[ancestor]
            allowed[i, cache.length + entries + i] = True
        ctx["keys"].append(k.transpose(0, 1))
        ctx["values"].append(v.transpose(0, 1))
        for i, node in enumerate(nodes):
            ctx["entry"][node] = entries + i
        keys = torch.cat([cache.keys, *ctx["keys"]], dim=1)
        values = torch.cat([cache.values, *ctx["values"]], dim=1)
        return _attend(q, keys, values, allowed)

    # ------------------------------------------------------------------ export
    @classmethod
    def export_vllm(cls, config, state, lm_head_weight, dtype):
        """vLLM's EAGLE-3 checkpoint (``Eagle3LlamaForCausalLM``): ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, and
        for a reduced draft vocabulary ``d2t`` (draft index -> target id offset) and ``t2d`` (target ids in the draft
        vocabulary); over the whole vocabulary vLLM has no such parameters and refuses to load them."""
        vocab = config.draft_vocab_size or config.vocab_size
        tensors = {k: v for k, v in state.items() if k != "draft_ids"}
        if vocab < config.vocab_size:
            draft_ids = state["draft_ids"]
            tensors["d2t"] = (draft_ids - torch.arange(vocab)).long()
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[draft_ids] = True
            tensors["t2d"] = t2d
        vllm_config = {
            "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": config.hidden_size, "target_hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "hidden_act": "silu", "vocab_size": config.vocab_size, "draft_vocab_size": vocab,
            "max_position_embeddings": 32768, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
                             "use_aux_hidden_state": True},
        }
        return vllm_config, {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().clone()
                             for k, v in sorted(tensors.items())}


    # ------------------------------------------------------------------ import
    PUBLIC_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")  # vLLM / speculators, SpecForge

    @classmethod
    def import_public(cls, public: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """The inverse of :meth:`export_vllm`: an EAGLE-3 checkpoint as vLLM, SpecForge and EAGLE's own training
        write it (``config.json`` + ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``) -> (this library's
        config dict, its state). A copy of the target's embeddings, if the checkpoint has one, is dropped (the
        drafter reads the target's own)."""
        if public.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"an EAGLE-3 drafter with {public['num_hidden_layers']} decoder layers: medusa_lite's "
                             "has one (EAGLE-3's own and SpecForge's default)")
        vocab = public["vocab_size"]
        draft = public.get("draft_vocab_size") or vocab
        aux = public.get("eagle_aux_hidden_state_layer_ids") or \
            (public.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        heads = public["num_attention_heads"]
        config = {"head_type": "eagle3", "hidden_size": public["hidden_size"], "vocab_size": vocab,
                  "draft_vocab_size": draft if draft < vocab else None, "aux_layers": aux,
                  "num_attention_heads": heads, "num_key_value_heads": public.get("num_key_value_heads", heads),
                  "head_dim": public.get("head_dim") or public["hidden_size"] // heads,
                  "intermediate_size": public["intermediate_size"], "rms_norm_eps": public.get("rms_norm_eps", 1e-6),
                  "rope_theta": _rope_theta(SimpleNamespace(**public))}
        state = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
        if draft < vocab:
            if "d2t" not in tensors:
                raise ValueError(f"draft_vocab_size {draft} < vocab_size {vocab} but the checkpoint has no d2t")
            state["draft_ids"] = tensors["d2t"].long() + torch.arange(draft)
        return config, state


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3)
        params = params["full_attention"]
    if isinstance(params, dict) and params.get("rope_theta"):
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", None) or 10000.0)
