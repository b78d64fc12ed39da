"""Per-iteration latency noise: real engines jitter (clocks, launch gaps, allocator,
neighbours), and their P99 inter-token latency is often set by that jitter, not by batch
composition. A latency model predicts one deterministic time per batch shape; noise multiplies
it by a factor of mean 1.

`latency.noise` in a scenario:

- `kind: none` (default): no noise.
- `kind: lognormal, sigma: s`: factor exp(s z - s^2/2), z standard normal, so E[factor] = 1.
- `kind: empirical`: the ratios measured/predicted the profile kept when it was fitted, by
  regime (decode-only, mixed, prefill-only iterations), rescaled to mean 1 (only latency models
  that carry measurements: `profile`).
- `correlation: phi` (0 <= phi < 1): consecutive iterations' z follow an AR(1),
  z_i = phi z_{i-1} + sqrt(1 - phi^2) e_i (still standard normal each), as GPU clocks drift;
  an empirical factor is the regime's quantile at Phi(z_i) (a Gaussian copula).

Determinism: the i-th iteration of a replica gets the i-th draw of that replica's own stream
(seeded from the scenario's seed and the replica's id), whatever asks for it: a stretch
predicted at once on arrays and the same iterations stepped one by one get identical factors,
bit for bit (draws are made in fixed blocks and looked up).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from sim.config.errors import INPUT_MODEL, invalid

BLOCK = 4096  # draws made at a time; a block's values do not depend on who asked first
NOISE_SPAWN_KEY = 0x6E6F6973  # "nois": keeps noise streams apart from routers' and arrivals'
REGIMES = ("decode", "mixed", "prefill")


class NoiseConfig(BaseModel):
    """`latency.noise`: none, lognormal with `sigma`, or the profile's empirical ratios."""

    model_config = INPUT_MODEL

    kind: Literal["none", "lognormal", "empirical"] = "none"
    sigma: float | None = Field(None, gt=0, le=3, description="lognormal: std of log factor")
    correlation: float = Field(0.0, ge=0, lt=1, description="AR(1) coefficient between "
                                                              "consecutive iterations")

    @model_validator(mode="after")
    def _sigma_for_lognormal(self) -> NoiseConfig:
        if self.kind == "lognormal" and self.sigma is None:
            raise invalid(("sigma", None, "lognormal noise needs sigma (e.g. 0.05)"))
        if self.kind != "lognormal" and self.sigma is not None:
            raise invalid(("sigma", self.sigma, f"only lognormal noise takes sigma, not "
                                                f"{self.kind}"))
        if self.kind == "none" and self.correlation:
            raise invalid(("correlation", self.correlation, "no noise to correlate"))
        return self

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def regime_index(num_prefill_tokens: Any, num_decode_tokens: Any) -> Any:
    """0 decode-only, 1 mixed, 2 prefill-only (element-wise on arrays)."""
    has_prefill = np.asarray(num_prefill_tokens) > 0
    has_decode = np.asarray(num_decode_tokens) > 0
    return np.where(has_prefill, np.where(has_decode, 1, 2), 0)


def mean_one_quantiles(ratios: np.ndarray, num_points: int = 257) -> np.ndarray:
    """The quantile function of `ratios` on an even grid of `num_points` in [0, 1], scaled so
    its mean (trapezoid rule, the mean of the factor drawn by linear interpolation at a uniform
    u) is exactly 1."""
    q = np.quantile(np.asarray(ratios, dtype=np.float64), np.linspace(0, 1, num_points))
    mean = float(((q[1:] + q[:-1]) / 2).mean())
    return q / mean


class IterationNoise:
    """The factors of one replica's iterations, by iteration index."""

    def __init__(self, config: NoiseConfig, seed: int, replica_id: int,
                 quantiles: dict[str, np.ndarray] | None = None) -> None:
        if config.kind == "empirical" and not quantiles:
            raise ValueError("empirical noise needs measured ratios (a profile latency model)")
        self.config = config
        seq = np.random.SeedSequence(seed, spawn_key=(NOISE_SPAWN_KEY, replica_id))
        self.rng = np.random.Generator(np.random.PCG64(seq))
        self.quantiles = [np.asarray(quantiles[r]) for r in REGIMES] if quantiles else None
        self.z_last = 0.0
        self.num_drawn = 0
        # Block b holds factors b*BLOCK .. (b+1)*BLOCK - 1: per regime an array (lognormal:
        # the same one thrice) and a list for scalar look-ups. Blocks are appended, never
        # copied, so drawing n factors costs O(n).
        self.blocks: list[list[np.ndarray]] = []
        self.block_lists: list[list[list[float]]] = []

    def _grow(self, n: int) -> None:
        """Draw whole blocks until index n exists."""
        while self.num_drawn <= n:
            e = self.rng.standard_normal(BLOCK)
            phi = self.config.correlation
            if phi:
                z = np.empty(BLOCK)
                scale = math.sqrt(1 - phi * phi)
                prev = self.z_last if self.num_drawn else None
                for i, x in enumerate(e.tolist()):  # a recurrence: one pass per block
                    prev = x if prev is None else phi * prev + scale * x
                    z[i] = prev
            else:
                z = e
            self.z_last = float(z[-1])
            if self.config.kind == "lognormal":
                sigma = float(self.config.sigma or 0.0)
                block = np.array([math.exp(sigma * x - sigma * sigma / 2) for x in z.tolist()])
                blocks = [block, block, block]
            else:
                assert self.quantiles is not None
                # Phi(z) with libm's erfc, entry by entry: the same on every CPU.
                u = np.array([0.5 * math.erfc(-x / math.sqrt(2)) for x in z.tolist()])
                blocks = [np.interp(u, np.linspace(0, 1, len(q)), q) for q in self.quantiles]
            self.blocks.append(blocks)
            lists = [b.tolist() for b in blocks[:1]] * 3 if blocks[0] is blocks[1] else [
                b.tolist() for b in blocks]
            self.block_lists.append(lists)
            self.num_drawn += BLOCK

    def factor(self, index: int, num_prefill_tokens: int, num_decode_tokens: int) -> float:
        """The factor of iteration `index` (a scalar)."""
        if index >= self.num_drawn:
            self._grow(index)
        regime = 0 if not num_prefill_tokens else 1 if num_decode_tokens else 2
        return self.block_lists[index // BLOCK][regime][index % BLOCK]

    def factors_from(self, start: int, n: int, num_prefill_tokens: Any,
                     num_decode_tokens: Any) -> np.ndarray:
        """The factors of iterations start .. start+n-1 (token counts: arrays of n, or
        scalars for all)."""
        if start + n - 1 >= self.num_drawn:
            self._grow(start + n - 1)
        first, last = start // BLOCK, (start + n - 1) // BLOCK
        offset = start - first * BLOCK
        # The blocks the range spans, joined (a stretch spans one or two).
        span = [np.concatenate([self.blocks[b][r] for b in range(first, last + 1)])
                if last > first else self.blocks[first][r] for r in range(3)]
        regime = np.broadcast_to(regime_index(num_prefill_tokens, num_decode_tokens), (n,))
        out = np.empty(n)
        for r in range(3):
            mask = regime == r
            if mask.any():
                out[mask] = span[r][offset:offset + n][mask]
        return out
