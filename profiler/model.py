"""A Llama/Mistral/Qwen-style decoder built from its shape alone, with random weights, and one
forward pass over a mixed batch of prefill chunks and decodes reading a shared KV pool.

Latency does not depend on weight values, so nothing is downloaded. Every request's KV lives in
its own stretch of slots of one pool per layer, `[slots, kv_heads, head_dim]`: attention reads
exactly the stated number of cached tokens, and each iteration writes its new tokens' KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sim.models import ModelShape


@dataclass
class SeqInput:
    """One request's part of an iteration."""

    kv_offset: int  # first slot of its KV stretch in the pool
    num_cached: int  # tokens already in the cache
    token_ids: torch.Tensor  # the new tokens
    samples: bool  # its last row goes through the LM head

    @property
    def num_new(self) -> int:
        return int(self.token_ids.numel())


class Decoder:
    """Weights, KV pool and `forward`. Not a `nn.Module`: inference only, no autograd."""

    def __init__(self, shape: ModelShape, num_kv_slots: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, q, kv, inter = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size

        def weight(*size: int) -> torch.Tensor:
            w = torch.randn(*size, generator=gen) * 0.02
            return w.to(device=self.device, dtype=dtype)

        self.embed = weight(shape.vocab_size, h)
        self.layers = [
            {"norm1": torch.ones(h, device=self.device, dtype=dtype),
             "qkv": weight(q + 2 * kv, h),
             "o": weight(h, q),
             "norm2": torch.ones(h, device=self.device, dtype=dtype),
             "gate_up": weight(2 * inter, h),
             "down": weight(h, inter)}
            for _ in range(shape.num_layers)
        ]
        self.final_norm = torch.ones(h, device=self.device, dtype=dtype)
        self.lm_head = self.embed if shape.tie_embeddings else weight(shape.vocab_size, h)
        pool = (num_kv_slots, shape.num_kv_heads, shape.head_dim)
        self.k_pool = [torch.randn(pool, generator=gen).to(self.device, dtype)
                       for _ in range(shape.num_layers)]
        self.v_pool = [torch.randn(pool, generator=gen).to(self.device, dtype)
                       for _ in range(shape.num_layers)]
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, shape.head_dim, 2).float()
                                         / shape.head_dim))
        self.inv_freq = inv_freq.to(self.device)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One iteration over the concatenated new tokens of `seqs`; returns the logits of the
        sampling rows only (intermediate chunks produce none)."""
        s = self.shape
        ids = torch.cat([x.token_ids for x in seqs]).to(self.device)
        positions = torch.cat([torch.arange(x.num_cached, x.num_cached + x.num_new)
                               for x in seqs]).to(self.device)
        slots = torch.cat([torch.arange(x.kv_offset + x.num_cached,
                                        x.kv_offset + x.num_cached + x.num_new)
                           for x in seqs]).to(self.device)
        cos, sin = self._rope(positions)
        hidden = self.embed[ids]
        for i, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer["norm1"])
            qkv = x @ layer["qkv"].T
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            q = _apply_rope(q.view(-1, s.num_heads, s.head_dim), cos, sin)
            k = _apply_rope(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin)
            self.k_pool[i][slots] = k
            self.v_pool[i][slots] = v.view(-1, s.num_kv_heads, s.head_dim)
            attn = self._attention(q, self.k_pool[i], self.v_pool[i], seqs)
            hidden = hidden + attn.reshape(-1, s.q_size) @ layer["o"].T
            x = _rms_norm(hidden, layer["norm2"])
            gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
            hidden = hidden + (F.silu(gate) * up) @ layer["down"].T
        rows = []
        end = 0
        for seq in seqs:
            end += seq.num_new
            if seq.samples:
                rows.append(end - 1)
        if not rows:
            return hidden[:0, :0]
        last = _rms_norm(hidden[torch.tensor(rows, device=self.device)], self.final_norm)
        return last @ self.lm_head.T

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   seqs: list[SeqInput]) -> torch.Tensor:
        """Per request: its queries against its whole context, causal (bottom-right aligned)
        for chunks. One SDPA call per request: the portable reference path."""
        out = torch.empty_like(q)
        start = 0
        for x in seqs:
            n, total = x.num_new, x.num_cached + x.num_new
            qs = q[start:start + n].transpose(0, 1)[None]  # [1, heads, n, d]
            ks = k_pool[x.kv_offset:x.kv_offset + total].transpose(0, 1)[None]
            vs = v_pool[x.kv_offset:x.kv_offset + total].transpose(0, 1)[None]
            mask = causal_lower_right(n, total) if n > 1 else None
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
