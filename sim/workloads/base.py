"""Workloads: where requests come from (a trace format or a synthetic generator).

Every format turns its input into a `Workload`, a few numpy columns in arrival order with the
first arrival at t=0; the common selection (time window, first N, rate scale) applies after.
A new format is one file with a config class, a `load` function and one registry decorator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from sim.config.errors import INPUT_MODEL, InputError, invalid
from sim.core.registry import Registry
from sim.workloads.classes import CLASSES_FIELD, RequestClassConfig, check_classes

# Tokens in one request's prompt or output. The longest contexts served today are about 10**7
# tokens; 10**9 leaves room while a chunk's causal attention pairs (about q**2 / 2) and every
# token sum stay far inside int64.
MAX_TOKENS = 10**9
# Requests in one run: the simulator keeps a Python object per request (a few hundred bytes
# with its token runs), so 10**7 requests already take gigabytes and hours.
MAX_REQUESTS = 10_000_000
# Simulated times are float64 seconds since the first arrival: below 2**32 s (136 years) they
# resolve 2**-20 s, about a microsecond, so TTFT and TBT keep their resolution.
MAX_SPAN_S = float(2**32)
# Arrivals per second, at most: a nanosecond apart on average, a thousand to the microsecond
# the results resolve, and far beyond any serving cluster (a replica's iteration takes about a
# millisecond). Without it a rate of 1e160 req/s put arrivals 1e-160 s apart, whose squares
# (the overload test's regression on arrival times) underflow to zero.
MAX_RATE_QPS = 1e9


@dataclass(frozen=True)
class Workload:
    """Requests as columns, sorted by arrival."""

    arrival_s: np.ndarray  # float64, seconds since the first arrival (before rate scaling)
    num_prompt_tokens: np.ndarray  # int64, >= 1
    num_output_tokens: np.ndarray  # int64, >= 1
    # Prefix-block ids (Mooncake, or generated), if any: requests sharing leading ids share a
    # prefix; each id stands for `hash_block_tokens` tokens (512 for Mooncake).
    hash_ids: list[tuple[int, ...]] | None = None
    hash_block_tokens: int = 0
    # int64, each request's load stage (a workload sent in `stages`), else None
    stage: np.ndarray | None = None
    # Sessions whose turns wait for the answer before (multi-turn conversations), else None.
    sessions: Sessions | None = None
    # int64, each request's class (an index into `workload.classes`), else None.
    request_class: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)

    def take(self, index: np.ndarray | slice) -> Workload:
        rows = np.arange(len(self))[index]
        hash_ids = None
        if self.hash_ids is not None:
            hash_ids = [self.hash_ids[i] for i in rows]
        return Workload(self.arrival_s[index], self.num_prompt_tokens[index],
                        self.num_output_tokens[index], hash_ids, self.hash_block_tokens,
                        None if self.stage is None else self.stage[index],
                        None if self.sessions is None else self.sessions.take(rows),
                        None if self.request_class is None else self.request_class[index])


@dataclass(frozen=True)
class Sessions:
    """Which request waits for which: request i is sent `delay_s[i]` after the answer to
    request `after[i]` reaches its client (-1: at its own arrival time), and, `paced`, not
    before its own arrival time either (a trace's follow-ups); each request's session and turn
    in it (from 0)."""

    after: np.ndarray  # int64, an earlier request's index in the workload, or -1
    delay_s: np.ndarray  # float64, the think time after that answer
    session: np.ndarray  # int64
    turn: np.ndarray  # int64
    paced: bool = False

    def take(self, rows: np.ndarray) -> Sessions:
        """The sessions of the requests at `rows`, in that order: a request whose predecessor
        was left out is sent at its own arrival time."""
        new_index = np.full(len(self.after), -1, dtype=np.int64)
        new_index[rows] = np.arange(len(rows))
        after = self.after[rows]
        after = np.where(after >= 0, new_index[np.maximum(after, 0)], -1)
        return Sessions(after, self.delay_s[rows], self.session[rows], self.turn[rows],
                        self.paced)


class ArrivalConfig(BaseModel):
    """Generated arrivals: Poisson; gamma inter-arrival times with a given CV (burstier > 1);
    or empirical, gaps drawn from `gap_quantiles` (a trace's gaps over their mean, at equally
    spaced probabilities from 0 to 1, linear between: `servesim fit-workload`), scaled so that
    the mean gap is 1 / `qps`. Each is a renewal process: gaps are drawn independently."""

    model_config = INPUT_MODEL

    process: Literal["poisson", "gamma", "empirical"] = "poisson"
    qps: float = Field(gt=0, description=f"arrivals per second (at most {MAX_RATE_QPS:.0e})")
    # Gamma's shape is 1/cv**2: the bounds keep it a normal float.
    cv: float = Field(1.0, ge=1e-3, le=1e3,
                      description="coefficient of variation of inter-arrival times (gamma)")
    gap_quantiles: list[float] | None = Field(
        None, min_length=2, max_length=10_001,
        description="inter-arrival times relative to their mean, at probabilities 0 to 1 "
                    "(empirical)")

    @model_validator(mode="after")
    def _cv_is_gamma(self) -> ArrivalConfig:
        if self.process != "gamma" and self.cv != 1.0:
            raise invalid(("cv", self.cv, f"{self.process} arrivals take no cv: use process: "
                                          "gamma"))
        if (self.process == "empirical") != (self.gap_quantiles is not None):
            raise invalid(("gap_quantiles", self.gap_quantiles,
                           "comes with process: empirical (and it with them)"))
        if self.gap_quantiles is not None:
            q = np.asarray(self.gap_quantiles, dtype=np.float64)
            if not (np.isfinite(q).all() and (q >= 0).all() and (q <= 1e6).all()):
                raise invalid(("gap_quantiles", self.gap_quantiles[:3],
                               "each a gap relative to the mean, in [0, 1e6]"))
            if (np.diff(q) < 0).any():
                i = int(np.argmax(np.diff(q) < 0)) + 1
                raise invalid(("gap_quantiles", self.gap_quantiles[:3],
                               f"must not decrease (item {i}, {q[i]:g}, after {q[i - 1]:g})"))
            if not _quantile_mean(q) > 0:
                raise invalid(("gap_quantiles", self.gap_quantiles[:3],
                               "every gap is 0: no rate to scale"))
        if self.qps > MAX_RATE_QPS:
            raise invalid(("qps", self.qps, TOO_FAST))
        return self

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        mean_gap_s = 1.0 / self.qps
        if self.process == "poisson":
            gaps = rng.exponential(mean_gap_s, num_requests)
        elif self.process == "gamma":
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, mean_gap_s / shape, num_requests)
        else:
            q = np.asarray(self.gap_quantiles, dtype=np.float64)
            u = rng.random(num_requests)
            gaps = np.interp(u * (len(q) - 1), np.arange(len(q)), q) * (
                mean_gap_s / _quantile_mean(q))
        gaps[0] = 0.0  # the first request opens the trace
        return np.cumsum(gaps)


def _quantile_mean(q: np.ndarray) -> float:
    """The mean of the distribution whose quantile function is `q`, linear between points:
    what scales drawn gaps to a mean of exactly 1 / qps."""
    return float(((q[1:] + q[:-1]) / 2).mean())


class WorkloadConfig(BaseModel):
    """Fields every format has: which format, and which part of its requests to take."""

    model_config = INPUT_MODEL

    format: str
    start_s: float = Field(0.0, ge=0, description="skip requests arriving before this time")
    end_s: float | None = Field(None, gt=0, description="drop requests arriving at or after it")
    num_requests: int | None = Field(None, gt=0, le=MAX_REQUESTS,
                                     description="then keep the first N")
    rate_scale: float = Field(1.0, gt=0, description="2.0 replays the arrivals at twice the rate")
    token_scale: float = Field(
        1.0, gt=0, le=1000,
        description="multiply prompt and output lengths (rounded, at least 1 token): a trace's "
                    "shape served by a smaller model or machine (e.g. replay on a CPU)")
    retime: ArrivalConfig | None = Field(
        None, description="new arrival times for the trace's requests (Poisson, gamma or "
                          "empirical gaps at a rate), keeping their order, lengths and prefix ids")
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_SPAN_S,
        description="the client gives up on a request not finished this long after it arrives: "
                    "the engine aborts it (its KV freed) and it counts as failed "
                    "(inference-perf's client: 300 s, aiohttp's default); none: never")
    classes: list[RequestClassConfig] | None = CLASSES_FIELD
    ignore_eos: bool = Field(
        False, description="the client's ignore_eos: true, the engine knows each output's length "
                           "(it runs to max_tokens); false, it may stop on EOS (SGLang then "
                           "estimates outputs: new_token_ratio). Each request still stops at its "
                           "output length. Unset: the format's client (true for shared_prefix, "
                           "inference-perf's; false otherwise, as vllm bench serve and "
                           "sglang.bench_serving send)")
    # The scenario file, named by errors of the selection (set by `parse_scenario`).
    _source: str = PrivateAttr("<scenario>")

    @model_validator(mode="before")
    @classmethod
    def _ignore_eos(cls, data: Any) -> Any:
        # Unset: the format's client's (spelled out in the resolved scenario).
        if isinstance(data, dict) and data.get("ignore_eos") is None:
            data = {**data, "ignore_eos": data.get("format") == "shared_prefix"}
        return data

    @model_validator(mode="after")
    def _classes(self) -> WorkloadConfig:
        check_classes(self.classes, getattr(getattr(self, "columns", None), "request_class", None))
        return self

    @model_validator(mode="after")
    def _window(self) -> WorkloadConfig:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise invalid(("end_s", self.end_s, f"must be after start_s ({self.start_s:g})"))
        if self.retime is not None:
            if getattr(self, "arrivals", None) is not None or "rate_qps" in type(
                    self).model_fields:
                raise invalid(("retime", self.retime.model_dump(),
                               f"the {self.format} format makes its own arrivals: set them "
                               "there (arrivals:, rate_qps)"))
            if self.rate_scale != 1.0:
                raise invalid(("rate_scale", self.rate_scale,
                               "has no effect with retime: set retime.qps"))
        return self


class Format(ABC):
    """A source of requests."""

    Config: ClassVar[type[WorkloadConfig]] = WorkloadConfig

    @abstractmethod
    def load(self, config: Any, base_dir: Path, rng: np.random.Generator) -> Workload:
        """Read or generate every request; `base_dir` resolves relative paths."""


FORMATS: Registry[type[Format]] = Registry("workload format", "sim.workloads", "FORMATS")


class TraceConfig(WorkloadConfig):
    path: Path = Field(strict=False)  # a string in YAML


class TraceSessionsConfig(BaseModel):
    """Sessions found in a trace's prefix ids (`sim.workloads.sessions`)."""

    model_config = INPUT_MODEL

    think_time_s: float = Field(
        0.0, ge=0, le=MAX_SPAN_S,
        description="a later turn waits at least this long after the answer to the turn it "
                    "continues (and is never sent before its time in the trace)")


class FilteredTraceConfig(TraceConfig):
    """A trace whose rows may be chosen by a condition on its own columns."""

    where: str | None = Field(
        None, min_length=1, max_length=10_000,
        description="keep the rows where this pandas expression over the file's columns is "
                    "true, e.g. \"Model == 'ChatGPT' and `Response tokens` > 0\" (backticks "
                    "around names with spaces); times then start at the first row kept")


SESSIONS_FIELD = Field(
    None, description="requests continuing earlier ones (by their prefix ids) wait for those "
                      "answers: sessions ({} for the defaults); none: sent at their times")


class PrefixTraceConfig(FilteredTraceConfig):
    """A trace with prefix ids, whose sessions may be replayed (`sim.workloads.sessions`)."""

    sessions: TraceSessionsConfig | None = SESSIONS_FIELD


class ArrivalsConfig(FilteredTraceConfig):
    """A file of request lengths without times: arrivals are generated."""

    arrivals: ArrivalConfig


class ColumnsConfig(BaseModel):
    model_config = INPUT_MODEL

    arrival: str | None = None
    prompt_tokens: str
    output_tokens: str
    hash_ids: str | None = None  # a column of lists of prefix-block ids (as Mooncake's)
    # A column of class names (`workload.classes`): each request's class, as the trace tags it.
    request_class: str | None = None


class GenericConfig(FilteredTraceConfig):
    """Any CSV or JSONL file: name its columns; arrivals from a column or generated."""

    columns: ColumnsConfig
    time_unit: Literal["s", "ms", "us", "datetime"] = "s"
    arrivals: ArrivalConfig | None = None
    hash_block_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="tokens each id of columns.hash_ids stands for")
    sessions: TraceSessionsConfig | None = SESSIONS_FIELD

    @model_validator(mode="after")
    def _one_arrival_source(self) -> GenericConfig:
        if (self.columns.arrival is None) == (self.arrivals is None):
            raise ValueError("give exactly one of columns.arrival and arrivals")
        if (self.columns.hash_ids is None) != (self.hash_block_tokens is None):
            raise invalid(("hash_block_tokens", self.hash_block_tokens,
                           "comes with columns.hash_ids (and they with it): how many tokens "
                           "each prefix-block id stands for"))
        if self.sessions is not None and self.columns.hash_ids is None:
            raise invalid(("sessions", self.sessions.model_dump(),
                           "are found in prefix ids: name them (columns.hash_ids)"))
        if self.arrivals is not None and self.time_unit != "s":
            raise invalid(("time_unit", self.time_unit, "has no effect on generated arrivals"))
        return self


def resolve(base_dir: Path, path: Path) -> Path:
    return path if path.is_absolute() else base_dir / path


def select(workload: Workload, config: WorkloadConfig) -> Workload:
    """Apply the time window, then the first N, then the rate scale. A selection that keeps no
    request, asks for more than there are, or spans too long to simulate is an error."""
    arrival = workload.arrival_s
    keep = arrival >= config.start_s
    if config.end_s is not None:
        keep &= arrival < config.end_s
    chosen = workload.take(np.flatnonzero(keep))
    source, last_s = config._source, float(arrival[-1]) if len(arrival) else 0.0
    if not len(chosen):
        field, value = ("end_s", config.end_s) if config.end_s is not None else (
            "start_s", config.start_s)
        end = "end" if config.end_s is None else f"{config.end_s:g}"
        raise InputError(source, f"workload.{field}", value,
                         f"the window [{config.start_s:g}, {end}) s holds no request "
                         f"(arrivals span 0 to {last_s:g} s)")
    if config.num_requests is not None:
        if config.num_requests > len(chosen):
            windowed = config.start_s > 0 or config.end_s is not None
            raise InputError(source, "workload.num_requests", config.num_requests,
                             f"only {len(chosen)} requests "
                             f"{'in the window' if windowed else 'in the trace'}")
        chosen = chosen.take(slice(0, config.num_requests))
    _check_rate(chosen.arrival_s, config)
    # Time restarts at the first kept arrival, then compresses by the rate scale (a tiny
    # scale overflows to inf, refused by `_check_span` without numpy's warning).
    with np.errstate(over="ignore"):
        shifted = (chosen.arrival_s - chosen.arrival_s[0]) / config.rate_scale
    _check_span(shifted, config)
    prompt, output = chosen.num_prompt_tokens, chosen.num_output_tokens
    hash_block_tokens = chosen.hash_block_tokens
    if config.token_scale != 1.0:
        prompt, output = (_scaled(n, config) for n in (prompt, output))
        # Prefix blocks shrink with the tokens they stand for (approximately, once rounded).
        hash_block_tokens = max(1, round(hash_block_tokens * config.token_scale))
    return Workload(shifted, prompt, output, chosen.hash_ids,
                    hash_block_tokens if chosen.hash_ids is not None else 0, chosen.stage,
                    chosen.sessions, chosen.request_class)


def _scaled(num_tokens: np.ndarray, config: WorkloadConfig) -> np.ndarray:
    """Token counts times `token_scale`, rounded, at least 1, at most MAX_TOKENS."""
    scaled = np.maximum(1.0, np.rint(num_tokens * config.token_scale))
    if scaled.max() > MAX_TOKENS:
        raise InputError(config._source, "workload.token_scale", config.token_scale,
                         f"makes a request of {scaled.max():.3g} tokens (at most {MAX_TOKENS:.0e})")
    return scaled.astype(np.int64)


TOO_FAST = (f"arrivals faster than {MAX_RATE_QPS:.0e} req/s (a nanosecond apart on average) "
            "are not simulated")


def _knob(config: WorkloadConfig) -> tuple[str, float]:
    """The field that set the arrival times: the rate scale, or (at scale 1) the rate of
    generated arrivals."""
    arrivals = getattr(config, "arrivals", None)
    if isinstance(arrivals, ArrivalConfig) and config.rate_scale == 1.0:
        return "workload.arrivals.qps", arrivals.qps
    return "workload.rate_scale", config.rate_scale


def _check_rate(arrival_s: np.ndarray, config: WorkloadConfig) -> None:
    """The mean arrival rate, once scaled, is at most MAX_RATE_QPS: the generated rate times
    the rate scale (the rate asked for, not the sample's, which a valid rate may exceed), or a
    trace's requests over their span times it. Requests that all arrive at one instant have
    no rate to scale."""
    arrivals = getattr(config, "arrivals", None)
    if isinstance(arrivals, ArrivalConfig):
        rate = arrivals.qps * config.rate_scale
    else:
        span_s = float(arrival_s[-1] - arrival_s[0])
        if not span_s > 0:
            return
        rate = (len(arrival_s) - 1) / span_s * config.rate_scale  # Python floats: inf, no error
    if rate > MAX_RATE_QPS:
        field, value = _knob(config)
        raise InputError(config._source, field, value,
                         f"makes {rate:.3g} arrivals per second; {TOO_FAST}")


def _check_span(arrival_s: np.ndarray, config: WorkloadConfig) -> None:
    """Arrival times must be finite and span less than MAX_SPAN_S; the error names the knob
    that set them: the rate scale, or the rate of generated arrivals."""
    span_s = float(arrival_s[-1]) if np.isfinite(arrival_s).all() else float("inf")
    if span_s < MAX_SPAN_S:
        return
    field, value = _knob(config)
    path = getattr(config, "path", None)
    # A trace's own times may be what is wrong (milliseconds read as seconds): name it too.
    whose = f" (the arrival times of {path}, scaled by {config.rate_scale:g})" if path else ""
    raise InputError(config._source, field, value,
                     f"arrivals span {span_s:.3g} s{whose}; simulated times keep microsecond "
                     f"resolution only below 2**32 s (136 years)")
