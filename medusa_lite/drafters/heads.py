"""Draft heads on the target's final-norm state: Medusa heads (h_t only) and Hydra heads (h_t + the drafted path).

Head k (0-based) proposes the token at t + 2 + k from the state h_t of the last accepted position t.
Medusa heads read h_t only. Hydra heads (arXiv:2402.05109) are sequentially dependent: head k also reads
the token at t + 1 + k and the state of head k - 1, so each proposal is conditioned on the path drafted
before it. Both project with the frozen target ``lm_head`` (or, ``share_lm_head=False``, a trained copy
per head), optionally restricted to a draft vocabulary (``draft_ids``)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import DynamicTree, tree_tokens
from ..verify import Proposals
from .base import Draft, Drafter, PathDrafter, num_positions
from .registry import register_drafter


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W`` zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # SiLU(0) = 0: an untrained head reproduces the base prediction
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


LOSSES = ("kl", "ce", "tvd", "kl+tvd")  # the training losses a drafter may use (see heads_loss)


class DistillLoss(torch.autograd.Function):
    """Per-position ``kl * KL(p || q) + tvd * 1/2 sum |p - q|`` with ``q = softmax(z)``, and its gradient in ``z`` in
    closed form: ``kl * (q - p) + tvd * 1/2 q (s - <s, q>)``, ``s = sign(q - p)``. The same numbers autograd gives
    (a test checks) in fewer passes over the [B, n, V'] tensors, without keeping autograd's copies (116 against 130 ms
    a head, forward and backward, [4, 251, 8192] bf16 logits, one CPU thread).

    z [B, n, V'] head logits (any float dtype), p [B, n, V'] and logp the teacher's probabilities and their log (fp32,
    no grad) -> [B, n] (fp32, or fp64 for fp64 logits)."""

    @staticmethod
    def forward(ctx, z, p, logp, kl: float, tvd: float):
        logq = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)  # [B, n, V'], fp32 or wider
        q = logq.exp()
        per_token = logq.new_zeros(z.shape[:-1])                        # [B, n]
        if kl:
            per_token += kl * (p * (logp - logq)).sum(-1)
        if tvd:
            per_token += tvd * 0.5 * (q - p).abs().sum(-1)
        ctx.save_for_backward(q, p)
        ctx.weights, ctx.dtype = (kl, tvd), z.dtype
        return per_token

    @staticmethod
    def backward(ctx, grad):                                            # grad [B, n]
        q, p = ctx.saved_tensors
        kl, tvd = ctx.weights
        dz = q - p                                                      # [B, n, V']
        s = torch.sign(dz) if tvd else None
        dz.mul_(kl)
        if tvd:
            dz += (s - (s * q).sum(-1, keepdim=True)).mul_(q).mul_(0.5 * tvd)
        return (dz.mul_(grad[..., None])).to(ctx.dtype), None, None, None, None


def heads_loss(
    head_logits: torch.Tensor,        # [K, B, T, V'] draft logits at every window position
    teacher_logits: torch.Tensor,     # [B, T, V'] target logits at the same positions (no grad)
    weights: torch.Tensor,            # [K, B, T] 1 where head k at t is trained
    input_ids: torch.Tensor | None = None,  # [B, T] data tokens (for loss="ce")
    *,
    loss: str = "kl",
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum over heads of ``decay**k * mean_t loss_k(t)`` and per-head statistics.

    Head k at t learns the token at t + 2 + k; its self-distillation teacher is the target's own
    distribution for that token, the target logits at t + 1 + k of the same window.
    ``loss="kl"``: ``KL(p_target(. | x<=t+1+k) || q_k(. | h_t))``; ``loss="ce"``: cross-entropy to the
    data token ``x_{t+2+k}``; ``loss="tvd"``: the total variation ``1/2 sum |p - q|``, which is one minus the
    chance that sampling (T = 1) accepts the head's draw, so it is the loss on expected acceptance; ``"kl+tvd"``:
    their sum. Returns (scalar loss, {"loss": [K], "top1": [K], "count": [K]}) where
    ``top1`` is the weighted number of positions whose head argmax equals the target argmax.
    """
    num_heads, _, seq_len, _ = head_logits.shape
    n = num_positions(seq_len, num_heads)
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if loss == "ce" and input_ids is None:
        raise ValueError("loss='ce' needs input_ids")
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1)   # [B, T, V']
        teacher_p = teacher_logp.exp() if loss != "ce" else None
        teacher_top1 = teacher_logits.max(dim=-1).indices               # [B, T] (max: twice argmax's speed on CPU)
    per_head = head_logits.unbind(0)  # K views [B, T, V']: their backward is one stack, where indexing head_logits[k]
    #                                   would zero a whole [K, B, T, V'] gradient for every head
    total = head_logits.new_zeros((), dtype=torch.float32)
    losses, top1, counts = [], [], []
    for k in range(num_heads):
        w = weights[k, :, :n].to(torch.float32)                         # [B, n]
        z = per_head[k][:, :n]                                          # [B, n, V']
        if loss != "ce":
            teacher = (teacher_p[:, 1 + k: 1 + k + n], teacher_logp[:, 1 + k: 1 + k + n])  # [B, n, V'] each
            per_token = DistillLoss.apply(z, *teacher, float("kl" in loss), float("tvd" in loss))  # [B, n]
        else:
            target = input_ids[:, 2 + k: 2 + k + n]                     # [B, n]
            per_token = -F.log_softmax(z.float(), dim=-1).gather(-1, target[..., None])[..., 0]
        count = w.sum()
        loss_k = (per_token * w).sum() / count.clamp(min=1)
        total = total + decay ** k * loss_k
        with torch.no_grad():
            hit = (z.max(-1).indices == teacher_top1[:, 1 + k: 1 + k + n]).float()
        losses.append(loss_k.detach())
        top1.append((hit * w).sum())
        counts.append(count)
    return total, {"loss": torch.stack(losses), "top1": torch.stack(top1), "count": torch.stack(counts)}


class HeadsDrafter(Drafter):
    """K heads of ``num_layers`` ResBlocks on h_t; what Medusa and Hydra heads share (projection, ranking,
    training). The vocabulary projection is the frozen target ``lm_head`` (referenced, never stored) or a
    per-head copy initialised from it (``config.share_lm_head=False``)."""

    def __init__(self, config):
        super().__init__(config)
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(config.num_layers))) for _ in range(config.num_heads))
        if config.draft_vocab_size is not None:  # token ids the heads may propose, filled by training
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.lm_heads = None
        if not config.share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads))
        self._projection: tuple | None = None

    def attach(self, target) -> None:
        super().attach(target)
        if self.lm_heads is not None:  # a fresh per-head lm_head starts as the target's
            with torch.no_grad():
                for lm_head in self.lm_heads:
                    lm_head.weight.copy_(self.target_lm_head.weight)

    # ------------------------------------------------------------------ vocabulary
    def draft_projection(self) -> torch.Tensor:
        """Weight [V', H] of the vocabulary the heads propose from (token ids: ``draft_ids``).

        With ``draft_vocab_size`` the rows of the shared ``lm_head`` for ``draft_ids`` are sliced once (and
        again only when the target's weights move or change dtype): drafting then reads V' rows per step.
        """
        weight = self.target_lm_head.weight
        ids = getattr(self, "draft_ids", None)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device,
               None if ids is None else (ids.data_ptr(), ids._version))
        if self._projection is None or self._projection[0] != key:
            self._projection = (key, weight if ids is None else weight[ids].contiguous())
        return self._projection[1]

    def logits(self, feats: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Head features -> logits over the draft vocabulary: [..., H] of head ``k``, or [K, ..., H] of every
        head (``k=None``) -> [..., V'] / [K, ..., V'] (V' = V without a draft vocabulary)."""
        if self.lm_heads is None:
            return F.linear(feats, self.draft_projection().to(feats.dtype))
        if k is not None:
            return self.lm_heads[k](feats)
        return torch.stack([lm_head(f) for lm_head, f in zip(self.lm_heads, feats)])

    def rank(self, feats: torch.Tensor, topk: int, k: int | None = None) -> torch.Tensor:
        """Head features (as :meth:`logits`) -> [..., topk] ranked token ids."""
        return self.token_ids(self.logits(feats, k).topk(topk, dim=-1).indices)

    # ------------------------------------------------------------------ training and calibration
    def features(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: hidden [B, T, H], ids [B, T] -> [K, B, T, H] per-head features."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] final-norm states, ids [B, T] -> logits [K, B, T, V'], head k at t scoring t + 2 + k.
        Heads read one position (and the tokens after it): ``segments`` is not needed."""
        return self.logits(self.features(hidden, ids))

    def loss(self, logits, teacher, weights, ids, *, loss="kl", decay=0.8):
        return heads_loss(logits, teacher, weights, ids, loss=loss, decay=decay)

    @torch.no_grad()
    def ranked(self, hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        """Head k at t ranks the token at t + 2 + k given the true tokens up to t + 1 + k: what decoding drafts
        on the path where every earlier proposal was right (calibration's accuracies)."""
        return self.rank(self.features(hidden[None], ids[None])[:, 0], topk)


@register_drafter
class MedusaDrafter(HeadsDrafter):
    """Medusa heads: head k reads h_t only, so one call ranks every depth of the tree at once."""

    name = "medusa"

    def features(self, hidden, ids=None):
        return torch.stack([block(hidden) for block in self.blocks])

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
        """hidden [H] of the last accepted position -> [K, topk] ranked draft tokens."""
        return self.rank(self.features(hidden[None, None])[:, 0, 0], topk)

    @torch.no_grad()
    def draft_row(self, hidden, ids, shape, max_depth, sampler=None, cache=None) -> Draft:
        """hidden [H]: one call ranks every depth of a static tree at once."""
        if isinstance(shape, DynamicTree):
            self.require_dynamic_trees()  # raises: Medusa heads cannot grow a tree
        if shape.num_nodes == 1:  # the root alone: nothing to draft
            return Draft(ids[-1:].clone(), shape)
        tokens, proposals = self.fill(hidden, ids, shape, sampler)
        return Draft(tokens, shape, proposals)

    def fill(self, hidden, ids, buffers, sampler):
        if sampler is None:
            return tree_tokens(ids[-1], self.draft(hidden, ids, buffers.topk), buffers), None
        feats = self.features(hidden[None, None])[:, 0, 0]  # [K, H]
        q, drawn = sampler(self.logits(feats), buffers.topk)  # [K, V'], [K, k]
        row = torch.full((buffers.num_nodes,), -1, dtype=torch.long, device=ids.device)
        rank = torch.zeros(buffers.num_nodes, dtype=torch.long, device=ids.device)
        row[1:], rank[1:] = buffers.draft_index // buffers.topk, buffers.draft_index % buffers.topk
        return (tree_tokens(ids[-1], self.token_ids(drawn), buffers),
                Proposals(q, drawn, row, rank, getattr(self, "draft_ids", None)))

    _BLOCK = re.compile(r"^blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)$")
    _LM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")

    @classmethod
    def export_vllm(cls, config, state, lm_head_weight, dtype):
        """vLLM's Medusa layout: ``blocks.{h}.layers.{l}.weight|bias``, ``lm_heads.{h}.weight`` (every head gets
        one: the shared lm_head, or its draft-vocabulary rows, is written once per head) and ``token_map``."""
        vllm_config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
                       "vocab_size": config.vocab_size, "num_heads": config.num_heads,
                       "num_hidden_layers": config.num_layers, "medusa_fc_bias": True,
                       "truncated_vocab_size": config.draft_vocab_size}
        out: dict[str, torch.Tensor] = {}
        token_map = state.get("draft_ids")
        for name, tensor in state.items():
            if name == "draft_ids":
                out["token_map"] = tensor
            elif m := cls._BLOCK.match(name):
                out[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = tensor
            elif m := cls._LM_HEAD.match(name):
                out[f"lm_heads.{m[1]}.weight"] = tensor
            else:
                raise ValueError(f"unexpected tensor {name!r} in heads state dict")
        if config.share_lm_head:
            if lm_head_weight is None:
                raise ValueError("heads share the target's lm_head: pass the target's lm_head weight")
            rows = lm_head_weight if token_map is None else lm_head_weight[token_map]
            for h in range(config.num_heads):
                out[f"lm_heads.{h}.weight"] = rows
        expected = {f"blocks.{h}.layers.{l}.{p}" for h in range(config.num_heads) for l in range(config.num_layers)
                    for p in ("weight", "bias")} | {f"lm_heads.{h}.weight" for h in range(config.num_heads)}
        expected |= {"token_map"} if token_map is not None else set()
        if set(out) != expected:
            raise ValueError(f"exported names do not match vLLM's layout: missing {sorted(expected - set(out))}, "
                             f"extra {sorted(set(out) - expected)}")
        return vllm_config, {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().clone()
                             for k, v in sorted(out.items())}


    PUBLIC_ARCHITECTURES = ("MedusaModel",)  # vLLM's Medusa layout (what export_vllm writes)
    _VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
    _FASTER_DECODING = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")  # {h}.{l}.linear.*, {h}.{L}.weight

    @classmethod
    def reads_public(cls, public: dict) -> bool:
        return super().reads_public(public) or "medusa_num_heads" in public  # FasterDecoding's config.json

    @classmethod
    def import_public(cls, public: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """Medusa heads as vLLM (``blocks.{h}.layers.{l}``, ``lm_heads.{h}``, ``token_map``) or FasterDecoding's
        Medusa (``{h}.{l}.linear``, ``{h}.{L}.weight``; ``medusa_num_heads``) publish them -> (config dict, state).
        Per-head lm_heads that are all the same are taken as the target's shared one (what export_vllm writes)."""
        heads = public.get("num_heads") or public["medusa_num_heads"]
        layers = public.get("num_hidden_layers") if "num_heads" in public else public.get("medusa_num_layers", 1)
        state, lm_heads = {}, {}
        for name, tensor in tensors.items():
            if m := cls._VLLM_BLOCK.match(name) or cls._FASTER_DECODING.match(name):
                h, l, kind = int(m[1]), int(m[2]), m[3]
                if l == layers:  # FasterDecoding: the head's own lm_head after its blocks
                    lm_heads[h] = tensor
                else:
                    state[f"blocks.{h}.{l}.linear.{kind}"] = tensor
            elif m := cls._LM_HEAD.match(name):
                lm_heads[int(m[1])] = tensor
            elif name != "token_map":
                raise ValueError(f"unexpected tensor {name!r} in a published Medusa checkpoint")
        shared = all(torch.equal(lm_heads[h], lm_heads[0]) for h in lm_heads)
        token_map = tensors.get("token_map")
        if token_map is not None and not shared:
            raise ValueError("a reduced draft vocabulary (token_map) with a different lm_head per head: medusa_lite's "
                             "draft vocabularies use the target's shared lm_head")
        if not shared:
            state |= {f"lm_heads.{h}.weight": w for h, w in lm_heads.items()}
        if token_map is not None:
            state["draft_ids"] = token_map.long()
        config = {"head_type": cls.name, "num_heads": heads, "num_layers": layers, "share_lm_head": shared,
                  "draft_vocab_size": None if token_map is None else int(token_map.numel())}
        return config, state


def _unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale the last dimension to unit RMS (token embeddings are far smaller than final-norm states)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


@register_drafter
class HydraDrafter(HeadsDrafter, PathDrafter):
    """Sequentially dependent heads: ``s_0 = h_t``; ``s_{k+1} = ResBlocks_k(W_k [s_k ; e(x_{t+1+k})])``.

    Head k scores the token at t + 2 + k from ``s_{k+1}``. ``W_k`` starts as ``[I, 0]``, so a fresh head
    reproduces the base prediction as a fresh Medusa head does. ``e`` is the target's frozen input embedding.
    Drafting runs level by level (:class:`PathDrafter`), each expanded node's row reading its own path.
    """

    name = "hydra"
    vllm_refusal = "Hydra heads read the drafted path and vLLM has no Hydra proposer; export Medusa heads, " \
                   "or serve these with medusa-lite serve"

    def __init__(self, config):
        super().__init__(config)
        h = config.hidden_size
        self.fuse = nn.ModuleList(nn.Linear(2 * h, h) for _ in range(config.num_heads))
        with torch.no_grad():
            for linear in self.fuse:
                linear.weight.zero_()
                linear.weight[:, :h].copy_(torch.eye(h))
                linear.bias.zero_()

    def step(self, k: int, state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Head k: state [..., H] and the embedding of the token it follows [..., H] -> new state [..., H]."""
        x = torch.cat([state, _unit_rms(token_embeds).to(state.dtype)], dim=-1)
        return self.blocks[k](self.fuse[k](x))

    def features(self, hidden, ids):
        """Teacher-forced: head k reads the data token at t + 1 + k (zero past the end)."""
        emb = self.target_embed(ids)  # [B, T, H]
        state, out = hidden, []
        for k in range(self.config.num_heads):
            follow = torch.zeros_like(emb)
            follow[:, : emb.shape[1] - 1 - k] = emb[:, 1 + k:]  # token at t + 1 + k
            state = self.step(k, state, follow)
            out.append(state)
        return torch.stack(out)  # [K, B, T, H]

    def begin(self, hidden, ids, cache):
        return {"state": hidden[None]}  # [1, H]: the root's parent state is h_t

    def advance_rows(self, ctxs, requests):
        """The rows' nodes of one depth through head ``depth`` together (one pass over its weights and the
        lm_head's)."""
        logits: list[torch.Tensor | None] = [None] * len(requests)
        by_depth: dict[int, list[int]] = {}
        for r, (depth, *_) in enumerate(requests):
            by_depth.setdefault(depth, []).append(r)
        for depth, rows in by_depth.items():
            sizes = [requests[r][2].numel() for r in rows]
            parent = torch.cat([ctxs[r]["state"][requests[r][1]] for r in rows])              # [sum M, H]
            state = self.step(depth, parent, self.target_embed(torch.cat([requests[r][2] for r in rows])))
            for r, row_state, row_logits in zip(rows, state.split(sizes), self.logits(state, depth).split(sizes)):
                ctxs[r]["state"], logits[r] = row_state, row_logits
        return logits
