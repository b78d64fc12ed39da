"""A Llama/Mistral/Qwen-style decoder built from its shape alone, with random weights, and one
forward pass over a mixed batch of prefill chunks and decodes reading a shared KV pool.

Latency does not depend on weight values, so nothing is downloaded. With `tensor_parallel` T > 1
it builds what one GPU of a Megatron-style tensor-parallel group holds (as vLLM shards a
decoder): num_heads/T query heads, num_kv_heads/T KV heads (one, replicated, where T exceeds
them), intermediate_size/T of the MLP and vocab_size/T rows of the LM head; the hidden size, the
embedding lookup and the norms are whole. No communication runs: the all-reduces a real group
adds are the latency model's (`sim.latency.profile`). Every request's KV lives in
its own stretch of slots of one pool per layer, `[slots, kv_heads, head_dim]`: attention reads
exactly the stated number of cached tokens, and each iteration writes its new tokens' KV. A
request's KV is one stretch of slots (`kv_offset`), or the blocks a paged cache gave it
(`block_ids`, as `servesim replay` keeps them): its slots are then gathered for attention.

Attention backends:
- `sdpa`: one `scaled_dot_product_attention` call per request (bottom-right causal mask for
  chunks). Portable (CPU and GPU) and the reference, but one launch per request per layer.
- `varlen`: one call per layer for the whole batch, FlashAttention over the paged pool
  (`torch.nn.attention.varlen.varlen_attn` with `block_table` and `seqused_k`), as vLLM runs
  it. CUDA only; its batch metadata is tested on the CPU against `reference_varlen`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sim.hardware.models import ModelShape
from sim.hardware.parallelism import Parallelism


@dataclass
class SeqInput:
    """One request's part of an iteration."""

    kv_offset: int  # first slot of its KV stretch in the pool (unused with `block_ids`)
    num_cached: int  # tokens already in the cache
    token_ids: torch.Tensor  # the new tokens
    samples: bool  # its last row goes through the LM head
    # Paged: the pool blocks holding its tokens, in order (token t in block_ids[t // size]).
    block_ids: torch.Tensor | None = None

    @property
    def num_new(self) -> int:
        return int(self.token_ids.numel())

    def slots(self, start: int, stop: int, block_size: int) -> torch.Tensor:
        """Pool slots of its tokens at positions [start, stop)."""
        if self.block_ids is None:
            return torch.arange(self.kv_offset + start, self.kv_offset + stop)
        pos = torch.arange(start, stop)
        return self.block_ids[pos // block_size] * block_size + pos % block_size


def unbuildable(shape: ModelShape) -> str | None:
    """Why the decoder cannot build `shape` (None: it can). It builds dense MLPs and
    grouped-query attention only: a mixture of experts or latent attention would be timed as
    another model, silently."""
    if shape.is_moe:
        return (f"a mixture of experts ({shape.num_experts} experts, {shape.num_experts_per_token} "
                "per token): the profiler builds dense decoders only, so it would time another "
                "model; use a dense model")
    if shape.is_mla:
        return ("multi-head latent attention (kv_lora_rank "
                f"{shape.kv_lora_rank}): the profiler builds grouped-query attention only, so it "
                "would time another model; use a model without MLA")
    return None


def footprint_bytes(shape: ModelShape, num_kv_slots: int, itemsize: int,
                    tensor_parallel: int = 1, block_size: int = 16) -> tuple[int, int]:
    """Bytes of the weights and of the KV pool that `Decoder` allocates (one shard's)."""
    t = tensor_parallel
    h = shape.hidden_size
    q = shape.num_heads // t * shape.head_dim
    kv = Parallelism(tensor=t).kv_heads_per_gpu(shape) * shape.head_dim
    inter = -(-shape.intermediate_size // t)
    per_layer = (q + 2 * kv) * h + h * q + 3 * inter * h + 2 * h
    lm_head = 0 if shape.tie_embeddings else -(-shape.vocab_size // t) * h
    weights = shape.vocab_size * h + shape.num_layers * per_layer + h + lm_head
    slots = -(-num_kv_slots // block_size) * block_size
    return weights * itemsize, 2 * shape.num_layers * slots * kv * itemsize


def memory_limit_bytes(device: str, root: Path = Path("/")) -> tuple[float, str]:
    """What the decoder may take on `device`, and how that was set: 80% of the memory free now
    (on the CPU, what Linux says it can give without swapping, within the cgroup's limit if
    one is set), else half the physical memory. `root`: where /proc and /sys are (tests)."""
    if device.startswith("cuda"):
        return 0.8 * torch.cuda.mem_get_info(torch.device(device))[0], "80% of the free GPU memory"
    available = available_memory_bytes(root)
    if available is not None:
        return 0.8 * available, "80% of the available memory"
    return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "half the memory"


def available_memory_bytes(root: Path = Path("/")) -> int | None:
    """Bytes this process could allocate without swapping: Linux's `MemAvailable`, less where
    a cgroup's memory limit leaves less (v2 `memory.max`, v1 `memory.limit_in_bytes`, less
    what the group uses); None where /proc/meminfo says nothing (not Linux)."""
    available = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    if available is None:
        return None
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file in (("memory.max", "memory.current"),  # v2, then v1
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1): no limit
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def does_not_fit(shape: ModelShape, num_kv_slots: int, device: str, dtype: torch.dtype,
                 tensor_parallel: int = 1, block_size: int = 16) -> tuple[str, bool] | None:
    """Why the decoder would not fit in memory on `device` (and whether its KV pool, rather
    than the weights, is the bulk), or None where it fits. Checked before anything is
    allocated: a model too big for the CPU otherwise ran the machine out of memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights, pool = footprint_bytes(shape, num_kv_slots, itemsize, tensor_parallel, block_size)
    limit, how = memory_limit_bytes(device)
    if weights + pool <= limit:
        return None
    return (f"its weights ({weights / 1e9:.1f} GB in {str(dtype).removeprefix('torch.')}) and "
            f"KV pool ({pool / 1e9:.1f} GB) do not fit in {limit / 1e9:.1f} GB ({how} here)",
            pool > weights)


class Decoder:
    """Weights, KV pool and `forward`. Not a `nn.Module`: inference only, no autograd."""

    def __init__(self, shape: ModelShape, num_kv_slots: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, attention: str = "sdpa",
                 block_size: int = 16, varlen_fn: Callable[..., Any] | None = None,
                 tensor_parallel: int = 1) -> None:
        if why := unbuildable(shape):
            raise ValueError(f"{shape.name}: {why}")
        problems = Parallelism(tensor=tensor_parallel).problems(shape)
        if problems:
            raise ValueError(f"tensor_parallel={tensor_parallel}: {problems[0][2]}")
        self.shape = shape
        self.tensor_parallel = t = tensor_parallel
        # This GPU's shard (the whole model when t == 1).
        self.num_heads = shape.num_heads // t
        self.num_kv_heads = Parallelism(tensor=t).kv_heads_per_gpu(shape)
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.intermediate_size = -(-shape.intermediate_size // t)
        self.lm_head_rows = -(-shape.vocab_size // t)
        self.attention = attention
        self.block_size = block_size
        if attention == "varlen" and varlen_fn is None:
            from torch.nn.attention.varlen import varlen_attn

            varlen_fn = varlen_attn
        self.varlen_fn = varlen_fn
        num_kv_slots = -(-num_kv_slots // block_size) * block_size
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, q, kv, inter = shape.hidden_size, self.q_size, self.kv_size, self.intermediate_size

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
        # Tied: the first rows of the embedding (a view, as contiguous as a weight of its own).
        self.lm_head = self.embed[:self.lm_head_rows] if shape.tie_embeddings \
            else weight(self.lm_head_rows, h)
        pool = (num_kv_slots, self.num_kv_heads, shape.head_dim)
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
        slots = torch.cat([x.slots(x.num_cached, x.num_cached + x.num_new, self.block_size)
                           for x in seqs]).to(self.device)
        cos, sin = self._rope(positions)
        meta = self._varlen_metadata(seqs) if self.attention == "varlen" else None
        hidden = self.embed[ids]
        for i, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer["norm1"])
            qkv = x @ layer["qkv"].T
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _apply_rope(q.view(-1, self.num_heads, s.head_dim), cos, sin)
            k = _apply_rope(k.view(-1, self.num_kv_heads, s.head_dim), cos, sin)
            self.k_pool[i][slots] = k
            self.v_pool[i][slots] = v.view(-1, self.num_kv_heads, s.head_dim)
            if meta is not None:
                attn = self._attention_varlen(q, self.k_pool[i], self.v_pool[i], meta)
            else:
                attn = self._attention(q, self.k_pool[i], self.v_pool[i], seqs)
            hidden = hidden + attn.reshape(-1, self.q_size) @ layer["o"].T
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
            if x.block_ids is None:
                ks = k_pool[x.kv_offset:x.kv_offset + total].transpose(0, 1)[None]
                vs = v_pool[x.kv_offset:x.kv_offset + total].transpose(0, 1)[None]
            else:  # scattered blocks: gather the context (a copy the slice above avoids)
                index = x.slots(0, total, self.block_size).to(self.device)
                ks = k_pool[index].transpose(0, 1)[None]
                vs = v_pool[index].transpose(0, 1)[None]
            mask = causal_lower_right(n, total) if n > 1 else None
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def _varlen_metadata(self, seqs: list[SeqInput]) -> dict[str, Any]:
        """Cumulative query lengths, KV lengths and block tables of the batch (built once per
        iteration, shared by every layer). Each request's KV starts on a block boundary."""
        bs = self.block_size
        num_new = [x.num_new for x in seqs]
        totals = [x.num_cached + x.num_new for x in seqs]
        pages = [-(-t // bs) for t in totals]
        table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
        for row, (x, n) in enumerate(zip(seqs, pages, strict=True)):
            if x.block_ids is not None:
                table[row, :n] = x.block_ids[:n]
                continue
            assert x.kv_offset % bs == 0, "varlen needs block-aligned KV"
            table[row, :n] = torch.arange(x.kv_offset // bs, x.kv_offset // bs + n)
        cu_q = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu_q[1:] = torch.cumsum(torch.tensor(num_new), 0)
        return {"cu_seq_q": cu_q.to(self.device), "max_q": max(num_new), "max_k": max(totals),
                "seqused_k": torch.tensor(totals, dtype=torch.int32, device=self.device),
                "block_table": table.to(self.device)}

    def _attention_varlen(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          meta: dict[str, Any]) -> torch.Tensor:
        assert self.varlen_fn is not None
        s = self.shape
        k_paged = k_pool.view(-1, self.block_size, self.num_kv_heads, s.head_dim)
        v_paged = v_pool.view(-1, self.block_size, self.num_kv_heads, s.head_dim)
        return self.varlen_fn(q, k_paged, v_paged, meta["cu_seq_q"], None, meta["max_q"],
                              meta["max_k"], seqused_k=meta["seqused_k"],
                              block_table=meta["block_table"], window_size=(-1, 0),
                              enable_gqa=True)


def reference_varlen(q: torch.Tensor, k_paged: torch.Tensor, v_paged: torch.Tensor,
                     cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None, max_q: int,
                     max_k: int, *, seqused_k: torch.Tensor, block_table: torch.Tensor,
                     window_size: tuple[int, int], enable_gqa: bool) -> torch.Tensor:
    """What `varlen_attn` computes over a paged KV pool, written with SDPA per request: the
    CPU stand-in that checks the metadata the varlen backend builds."""
    assert cu_seq_k is None and window_size == (-1, 0) and enable_gqa
    out = torch.empty_like(q)
    heads, dim = k_paged.shape[2], k_paged.shape[3]
    for i in range(len(seqused_k)):
        start, end = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        total = int(seqused_k[i])
        pages = block_table[i, : -(-total // k_paged.shape[1])].long()
        k = k_paged[pages].reshape(-1, heads, dim)[:total].transpose(0, 1)[None]
        v = v_paged[pages].reshape(-1, heads, dim)[:total].transpose(0, 1)[None]
        qs = q[start:end].transpose(0, 1)[None]
        n = end - start
        mask = causal_lower_right(n, total) if n > 1 else None
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
