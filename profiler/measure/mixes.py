"""Batch mixes: what one measured iteration computes, and the grids of them the profiler times.

A mix is a list of prefill chunks (new tokens after some cached context) and a list of decode
contexts. Its features are the simulator's `BatchShape`, so measured and simulated iterations
are described the same way. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from sim.latency.base import BatchShape


@dataclass(frozen=True)
class Chunk:
    num_new_tokens: int
    num_cached_tokens: int = 0
    samples: bool = True  # the prompt's last chunk: its last row goes through the LM head


@dataclass(frozen=True)
class Mix:
    chunks: tuple[Chunk, ...] = ()
    decode_contexts: tuple[int, ...] = ()  # cached tokens of each decoding request
    tag: str = ""  # which part of the grid it came from

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks) + len(self.decode_contexts)

    @property
    def max_context(self) -> int:
        lengths = [c.num_cached_tokens + c.num_new_tokens for c in self.chunks]
        return max(lengths + [c + 1 for c in self.decode_contexts], default=0)

    @property
    def num_kv_tokens(self) -> int:
        """KV slots the mix touches (each request's whole context)."""
        return (sum(c.num_cached_tokens + c.num_new_tokens for c in self.chunks)
                + sum(c + 1 for c in self.decode_contexts))

    def shape(self) -> BatchShape:
        s = BatchShape()
        for c in self.chunks:
            q, p = c.num_new_tokens, c.num_cached_tokens
            s.num_prefill_tokens += q
            s.num_prefill_seqs += 1
            s.prefill_attn_pairs += q * p + q * (q + 1) // 2
            s.prefill_kv_tokens += p + q
            s.num_sampled_tokens += int(c.samples)
        s.num_decode_tokens = len(self.decode_contexts)
        s.num_sampled_tokens += len(self.decode_contexts)
        s.decode_kv_tokens = sum(c + 1 for c in self.decode_contexts)
        return s

    def to_json(self) -> str:
        return json.dumps({"chunks": [[c.num_new_tokens, c.num_cached_tokens, int(c.samples)]
                                      for c in self.chunks],
                           "decodes": list(self.decode_contexts)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, tag: str = "") -> Mix:
        data = json.loads(text)
        chunks = tuple(Chunk(q, p, bool(s)) for q, p, s in data["chunks"])
        return cls(chunks, tuple(data["decodes"]), tag)

    @property
    def key(self) -> str:
        """Identity of a mix, for resuming: its JSON."""
        return self.to_json()


@dataclass(frozen=True)
class GridSpec:
    """The ranges a profile covers; `servesim profile` picks one per model and device."""

    max_tokens: int  # most tokens in one iteration
    max_context: int  # longest context of any request
    max_batch: int  # most decoding requests in one iteration
    max_kv_tokens: int  # KV slots the profiler may allocate in total
    token_knots: tuple[int, ...] = field(default=())

    def knots(self) -> list[int]:
        return list(self.token_knots) or default_knots(self.max_tokens)


def default_knots(max_tokens: int) -> list[int]:
    """Token counts timed densely: every 16 to 512, then every 64 to 2048, then every 256; plus
    each multiple of 128 and the count one past it, where GEMM tiles quantise."""
    knots = {1, 2, 4, 8}
    knots.update(range(16, min(max_tokens, 512) + 1, 16))
    knots.update(range(512, min(max_tokens, 2048) + 1, 64))
    knots.update(range(2048, max_tokens + 1, 256))
    for m in range(128, max_tokens + 1, 128):
        knots.update((m, m + 1))
    return sorted(k for k in knots if k <= max_tokens)


def grid(spec: GridSpec, rng: np.random.Generator) -> list[Mix]:
    """The training mixes: token sweeps, prefill with context, decode batches (equal and
    skewed contexts), and mixed batches."""
    mixes: list[Mix] = []
    contexts = [c for c in (0, 512, 2048, 4096, 8192, 16384, 32768) if c <= spec.max_context]
    for n in spec.knots():  # GEMM cost against total tokens, little attention
        mixes.append(Mix((Chunk(n),), tag="tokens"))
    for q in (1, 4, 16, 64, 256, 1024, 4096):
        if q > spec.max_tokens:
            continue
        for p in contexts[1:]:
            if p + q <= spec.max_context:
                mixes.append(Mix((Chunk(q, p),), tag="prefill_context"))
    for num_chunks in (2, 3):  # several prefills in one iteration, some mid-prompt
        for q in (8, 64, 256, 1024):
            if num_chunks * q > spec.max_tokens:
                continue
            for p in contexts:
                chunks = tuple(Chunk(q, int(rng.integers(0, p + 1)), bool(i % 2))
                               for i in range(num_chunks))
                if all(c.num_cached_tokens + q <= spec.max_context for c in chunks):
                    mixes.append(Mix(chunks, tag="prefill_multi"))
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256) if b <= spec.max_batch]
    for b in batches:
        for mean in (128, 1024, 4096, 16384):
            if mean > spec.max_context:
                continue
            mixes.append(Mix(decode_contexts=(mean - 1,) * b, tag="decode_equal"))
            mixes.append(Mix(decode_contexts=skewed(b, mean, spec, rng), tag="decode_skewed"))
    for q in (64, 256, 1024):
        for b in batches[::2]:
            if q + b <= spec.max_tokens:
                mixes.append(Mix((Chunk(q, int(rng.integers(0, spec.max_context // 4 + 1))),),
                                 skewed(b, 1024, spec, rng), tag="mixed"))
    return [m for m in mixes if m.num_kv_tokens <= spec.max_kv_tokens]


def skewed(batch: int, mean: int, spec: GridSpec, rng: np.random.Generator) -> tuple[int, ...]:
    """Decode contexts with a heavy tail (lognormal, CV 1.5) around `mean`."""
    sigma2 = np.log1p(1.5**2)
    draws = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), batch)
    return tuple(int(c) for c in np.clip(draws, 1, spec.max_context - 1).astype(int))


def random_mixes(spec: GridSpec, n: int, rng: np.random.Generator) -> list[Mix]:
    """Held-out mixes, drawn at random across the whole range (none is on the grid)."""
    mixes: list[Mix] = []
    while len(mixes) < n:
        budget = int(rng.integers(1, spec.max_tokens + 1))
        num_decodes = int(rng.integers(0, min(spec.max_batch, budget) + 1))
        prefill = budget - num_decodes
        num_chunks = min(prefill, int(rng.integers(0, 4)))
        chunks = []
        if num_chunks:
            # Split the prefill tokens at random points among the chunks.
            cuts = np.sort(rng.choice(np.arange(1, prefill), num_chunks - 1, replace=False))
            for q in np.diff(np.concatenate(([0], cuts, [prefill]))).tolist():
                p = int(rng.integers(0, max(1, spec.max_context - q)))
                chunks.append(Chunk(q, p, bool(rng.integers(0, 2))))
        elif num_decodes == 0:
            continue
        mean = int(rng.integers(16, spec.max_context // 2 + 1))
        decodes = skewed(num_decodes, mean, spec, rng) if num_decodes else ()
        mix = Mix(tuple(chunks), decodes, tag="holdout")
        if 0 < mix.num_tokens <= spec.max_tokens and mix.num_kv_tokens <= spec.max_kv_tokens:
            mixes.append(mix)
    return mixes
