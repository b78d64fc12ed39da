"""Generated requests: arrivals from a process, lengths from distributions or a length file."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from sim.config.errors import INPUT_MODEL, Problem, invalid
from sim.workloads.base import (
    FORMATS,
    MAX_REQUESTS,
    MAX_TOKENS,
    ArrivalConfig,
    Format,
    Workload,
    WorkloadConfig,
    resolve,
)
from sim.workloads.cache import read_table
from sim.workloads.fields import token_counts

PARAMS = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("mean", "std"),
          "empirical": ("quantiles",)}
MAX_QUANTILES = 10_001  # an empirical distribution's points, at most
# A lognormal clipped so hard that fewer draws than this stay inside [min, max] is no longer
# the distribution asked for (mean 10, min 1000 makes every length 1000): refused, as a fixed
# value or uniform range outside [min, max] is.
MIN_UNCLIPPED = 1e-3


class TokenDist(BaseModel):
    """fixed: `value`; uniform: integers in [`low`, `high`]; lognormal: `mean` and `std` of the
    token count itself; empirical: `quantiles`, the values at equally spaced probabilities from
    0 to 1 (a trace's percentiles, say: `servesim fit-workload`), linear between; every draw is
    rounded and clipped to [`min`, `max`] (`max` defaults to MAX_TOKENS, the most one request
    may have)."""

    model_config = INPUT_MODEL

    dist: Literal["fixed", "uniform", "lognormal", "empirical"]
    value: int | None = Field(None, ge=1, le=MAX_TOKENS)
    low: int | None = Field(None, ge=1, le=MAX_TOKENS)
    high: int | None = Field(None, ge=1, le=MAX_TOKENS)
    mean: float | None = Field(None, ge=1, le=MAX_TOKENS)
    std: float | None = Field(None, gt=0, le=MAX_TOKENS)
    min: int = Field(1, ge=1, le=MAX_TOKENS)
    max: int | None = Field(None, ge=1, le=MAX_TOKENS)
    quantiles: list[float] | None = Field(None, min_length=2, max_length=MAX_QUANTILES)

    @model_validator(mode="after")
    def _params(self) -> TokenDist:
        needed = PARAMS[self.dist]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{self.dist} needs {', '.join(missing)}")
        problems = [(name, getattr(self, name), f"not a parameter of {self.dist}")
                    for names in PARAMS.values() for name in names
                    if name not in needed and getattr(self, name) is not None]
        problems += self._clipping()
        if self.quantiles is not None:
            q = np.asarray(self.quantiles)
            if not (np.isfinite(q).all() and (q >= 1).all() and (q <= MAX_TOKENS).all()):
                problems.append(("quantiles", self.quantiles[:3],
                                 f"each a number of tokens in [1, {MAX_TOKENS}]"))
            elif (np.diff(q) < 0).any():
                problems.append(("quantiles", self.quantiles[:3], "must not decrease"))
        if problems:
            raise invalid(*problems)
        return self

    def _clipping(self) -> list[Problem]:
        """Bounds that would silently change the distribution asked for."""
        top = MAX_TOKENS if self.max is None else self.max
        if self.min > top:
            return [("min", self.min, f"above max ({top})")]
        if self.dist == "uniform" and self.low > self.high:  # type: ignore[operator]
            return [("low", self.low, f"above high ({self.high})")]
        if self.dist == "lognormal":
            return self._lognormal_clipping(top)
        exact = {"fixed": ("value",), "uniform": ("low", "high")}.get(self.dist, ())
        return [(name, getattr(self, name), f"outside [min, max] = [{self.min}, {top}]")
                for name in exact if not self.min <= getattr(self, name) <= top]

    def _lognormal_clipping(self, top: int) -> list[Problem]:
        """[min, max] leaving fewer than MIN_UNCLIPPED of the draws unclipped (min equal to max
        included), from the lognormal's CDF (before rounding, which moves a bound by at most half
        a token). Named at the bound that clips more."""
        assert self.mean is not None and self.std is not None
        # As in `sample`: log(X) is normal with these mu and sigma.
        sigma2 = math.log1p((self.std / self.mean) ** 2)
        mu = math.log(self.mean) - sigma2 / 2
        # A std below ~1e-154 of the mean makes sigma 0: a point mass, still no division by 0.
        scale = max(math.sqrt(2 * sigma2), sys.float_info.min)

        def below(x: float) -> float:  # P(X < x) for the lognormal drawn in `sample`
            return 0.5 * math.erfc(-(math.log(x) - mu) / scale)

        def above(x: float) -> float:  # P(X > x), accurate far in the upper tail
            return 0.5 * math.erfc((math.log(x) - mu) / scale)

        low, high = below(self.min), above(top)
        if 1 - low - high >= MIN_UNCLIPPED:
            return []
        name, bound = ("min", self.min) if low >= high else ("max", top)
        return [(name, bound, f"clips {low + high:.3%} of lognormal draws (mean {self.mean:g}, "
                 f"std {self.std:g}) to [min, max] = [{self.min}, {top}]: at most "
                 f"{1 - MIN_UNCLIPPED:.1%} may be clipped")]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.dist == "empirical":
            return self.at(rng.random(n))
        if self.dist == "fixed":
            draws = np.full(n, float(self.value))  # type: ignore[arg-type]
        elif self.dist == "uniform":
            draws = rng.integers(self.low, self.high, n, endpoint=True).astype(np.float64)  # type: ignore[arg-type]
        else:
            assert self.mean is not None and self.std is not None
            sigma2 = np.log1p((self.std / self.mean) ** 2)
            draws = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), n)
        top = MAX_TOKENS if self.max is None else self.max
        return np.clip(np.rint(draws), self.min, top).astype(np.int64)

    def at(self, u: np.ndarray) -> np.ndarray:
        """The token counts at probabilities `u` (the quantile function): what correlated
        lengths are drawn through (`LengthsConfig.rank_correlation`)."""
        if self.dist == "fixed":
            draws = np.full(len(u), float(self.value))  # type: ignore[arg-type]
        elif self.dist == "uniform":
            assert self.low is not None and self.high is not None
            draws = np.minimum(self.low + np.floor(u * (self.high - self.low + 1)), self.high)
        elif self.dist == "lognormal":
            from scipy.stats import norm  # (here: a plain run imports no scipy)

            assert self.mean is not None and self.std is not None
            sigma2 = np.log1p((self.std / self.mean) ** 2)
            draws = np.exp(np.log(self.mean) - sigma2 / 2 + np.sqrt(sigma2) * norm.ppf(u))
        else:
            q = np.asarray(self.quantiles, dtype=np.float64)
            draws = np.interp(u * (len(q) - 1), np.arange(len(q)), q)
        top = MAX_TOKENS if self.max is None else self.max
        return np.clip(np.rint(draws), self.min, top).astype(np.int64)


class LengthsConfig(BaseModel):
    """Either both token distributions, or a length CSV whose rows are drawn with replacement."""

    model_config = INPUT_MODEL

    prompt: TokenDist | None = None
    output: TokenDist | None = None
    file: Path | None = Field(None, strict=False)  # a string in YAML
    rank_correlation: float | None = Field(
        None, ge=-1, le=1, description="Spearman correlation of prompt and output lengths "
                                       "(a Gaussian copula); none: drawn apart")

    @model_validator(mode="after")
    def _one_source(self) -> LengthsConfig:
        if self.file is not None and (self.prompt is not None or self.output is not None):
            raise ValueError("give either file, or prompt and output, not both")
        if self.file is None and (self.prompt is None or self.output is None):
            raise ValueError("give either file, or both prompt and output")
        if self.file is not None and self.rank_correlation is not None:
            raise invalid(("rank_correlation", self.rank_correlation,
                           "has no effect with a length file (its rows keep their own)"))
        return self

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Prompt and output lengths of `n` requests: apart, or through a Gaussian copula
        with the rank correlation asked for (Pearson's r = 2 sin(pi rho / 6) gives it)."""
        assert self.prompt is not None and self.output is not None
        if self.rank_correlation is None:
            return self.prompt.sample(n, rng), self.output.sample(n, rng)
        from scipy.stats import norm  # (here: a plain run imports no scipy)

        r = 2 * math.sin(math.pi * self.rank_correlation / 6)
        z = rng.standard_normal((2, n))
        z[1] = r * z[0] + math.sqrt(max(1 - r * r, 0.0)) * z[1]
        return self.prompt.at(norm.cdf(z[0])), self.output.at(norm.cdf(z[1]))


class SyntheticConfig(WorkloadConfig):
    num_requests: int = Field(gt=0, le=MAX_REQUESTS)  # type: ignore[assignment]  # required here
    arrivals: ArrivalConfig
    lengths: LengthsConfig


@FORMATS.register("synthetic")
class Synthetic(Format):
    Config = SyntheticConfig

    def load(self, config: SyntheticConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        n = config.num_requests
        arrival = config.arrivals.sample(n, rng)
        lengths = config.lengths
        if lengths.file is not None:
            path = resolve(base_dir, lengths.file)
            table = read_table(path, "csv", "workload.lengths.file",
                               ["num_prefill_tokens", "num_decode_tokens"])
            prompt_all = token_counts(table, "num_prefill_tokens", path)
            output_all = token_counts(table, "num_decode_tokens", path)
            rows = rng.integers(0, len(prompt_all), n)
            return Workload(arrival, prompt_all[rows], output_all[rows])
        return Workload(arrival, *lengths.sample(n, rng))
