"""The EAGLE-3 drafter's one decoder layer (vLLM's ``llama_eagle3.py`` ``midlayer``), its attention with RoPE and its
MLP: modules and pure functions, with no cache of their own (the drafter keeps the cache, :mod:`.eagle3`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout): x [..., T, heads, D], cos / sin [..., T, 1, D] -> x's shape."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [..., T] -> (cos, sin) [..., T, 1, D] for :func:`rope`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq                                      # [..., T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[..., None, :]                                      # [..., T, 1, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read the 2H-wide ``[embeds ; hidden]`` input."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, theta: float):
        """x [..., T, 2H] -> q [..., T, heads, D], k, v [..., T, kv_heads, D] (q, k rotated)."""
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.kv_heads, self.head_dim)
        cos, sin = rope_angles(positions, self.head_dim, theta, q.dtype)
        return rope(q, cos, sin), rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's EAGLE-3 ``midlayer``: attention over ``[input_layernorm(embeds) ; hidden_norm(hidden)]``, residual
    on ``hidden``, then ``post_attention_layernorm`` and the MLP. Returns the pre-norm output."""

    def __init__(self, config):  # an Eagle3Config
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.mlp = MLP(h, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        dtype = self.hidden_norm.weight.dtype  # norms in the drafter's dtype (under autocast the inputs are bf16)
        return torch.cat([self.input_layernorm(embeds.to(dtype)), self.hidden_norm(hidden.to(dtype))], dim=-1)  # [.., 2H]

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn [..., heads * D] (before o_proj), the layer's hidden input -> pre-norm output [..., H]."""
        h = self.self_attn.o_proj(attn) + hidden
        return self.mlp(self.post_attention_layernorm(h.to(self.post_attention_layernorm.weight.dtype))) + h
