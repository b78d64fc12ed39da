"""Latency fitted to measured iterations (see `profiler/`).

    time = g(num_tokens) + sum_i coef_i * feature_i

`g` is piecewise linear over token counts measured densely (the GEMMs, weight reads and the
per-iteration overhead, tile-quantization steps included); the other terms follow attention and
the LM head: prefill query-key pairs, KV tokens read by prefill chunks and by decodes, decode and
prefill request counts, sampled rows. A prediction is one `np.interp` and a few multiply-adds.
Shapes beyond the measured range are counted and reported in the run summary, never silently
trusted.

A profile measured with `servesim profile --tensor-parallel T` times one GPU's shard of a
tensor-parallel replica (its heads, KV heads, MLP width and LM-head rows divided by T) and
records `tensor_parallel: T`; it predicts replicas with `parallelism: {tensor: T}` only, adding
the communication the shard did not do, as the roofline charges it (`sim.latency.comm`): two
all-reduces of the activations per layer and one after the embedding, from a measured table
(`all_reduce_table`) or the GPU's interconnect bandwidth (`interconnect_efficiency`,
`all_reduce_latency_s`), and the gather of the sampled rows' logits (from the bandwidth).

A profile fitted by this version also keeps what the fit leaves unexplained (`noise.regimes`:
quantiles of measured/predicted by regime; `noise.correlation`: their lag-1 correlation in run
order, see `profiler.fit.fitting.measured_noise`), for `latency.noise: {kind: empirical}`; an
older one has none, and empirical noise is refused with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    ValidationError,
    model_validator,
)

from sim.config.errors import INPUT_MODEL, InputError, Problem, invalid
from sim.config.input_file import read_json_file
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import MAX_GPUS_PER_REPLICA, SINGLE_GPU, Parallelism
from sim.latency.base import (
    LATENCY_MODELS,
    BatchShape,
    LatencyConfig,
    LatencyModel,
    Num,
    TokenTable,
)
from sim.latency.comm import (
    ALL_REDUCE_LATENCY_S,
    INTERCONNECT_EFFICIENCY,
    SEND_RECV_LATENCY_S,
    BandwidthCollectives,
    Collectives,
)
from sim.latency.noise import REGIMES, mean_one_quantiles

FORMAT = "servesim-latency-profile/1"
# A fitted file is tens of kilobytes (knots, coefficients, noise quantiles); far past that it
# is not one `servesim fit` wrote, and is not read into memory.
MAX_FITTED_BYTES = 16 * 2**20
TERMS = ("prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens", "num_decode_tokens",
         "num_prefill_seqs", "num_sampled_tokens")
RANGE_FEATURES = ("num_tokens", "prefill_attn_pairs", "decode_kv_tokens", "num_decode_tokens")


def token_curve(num_tokens: Num, knots: np.ndarray, values: np.ndarray) -> Num:
    """Piecewise-linear g(num_tokens), extended past the last knot along the slope of its upper
    half (from the first knot at or above half the last one), never downwards: the last
    segment alone can be a few tokens wide and noisy, and once sloped down it would predict
    negative times for large iterations. (Fits use only the measured range.)"""
    j = min(int(np.searchsorted(knots, knots[-1] / 2)), len(knots) - 2)
    slope = max(0.0, float((values[-1] - values[j]) / (knots[-1] - knots[j])))
    beyond = np.maximum(np.asarray(num_tokens, dtype=np.float64) - knots[-1], 0.0)
    return np.interp(num_tokens, knots, values) + beyond * slope


def knot_basis(num_tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Columns whose weighted sum is `token_curve`: the fit is linear in the knot values."""
    eye = np.eye(len(knots))
    return np.stack([token_curve(num_tokens, knots, eye[j]) for j in range(len(knots))], axis=1)


def predict_s(shape: BatchShape, knots: np.ndarray, knot_s: np.ndarray,
              coef: Sequence[float]) -> Num:
    """The fitted model's time for `shape` (fields scalars or arrays); `coef` in TERMS order."""
    c = coef
    return (token_curve(shape.num_tokens, knots, knot_s)
            + c[0] * shape.prefill_attn_pairs + c[1] * shape.prefill_kv_tokens
            + c[2] * shape.decode_kv_tokens + c[3] * shape.num_decode_tokens
            + c[4] * shape.num_prefill_seqs + c[5] * shape.num_sampled_tokens)


class ProfileConfig(LatencyConfig):
    model_config = INPUT_MODEL

    path: Path = Field(strict=False, description="a fitted profile (`servesim fit` output)")
    # Communication of a tensor-parallel profile (tensor_parallel > 1), as the roofline's.
    all_reduce_table: Path | None = Field(
        None, strict=False, description="measured all-reduce CSV (Vidur layout); None: from "
                                        "the GPU's interconnect bandwidth")
    interconnect_efficiency: float = Field(
        INTERCONNECT_EFFICIENCY, gt=0, le=1,
        description="fraction of link bandwidth collectives reach")
    all_reduce_latency_s: float = Field(ALL_REDUCE_LATENCY_S, ge=0, le=1,
                                        description="start-up per all-reduce")


@LATENCY_MODELS.register("profile")
class ProfileLatency(LatencyModel):
    Config = ProfileConfig

    def __init__(self, config: ProfileConfig, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism = SINGLE_GPU) -> None:
        if parallelism.pipeline > 1 or parallelism.expert > 1:
            raise InputError(config.path, "parallelism", parallelism.model_dump(),
                             "a profile times one GPU of a tensor-parallel replica; pipeline "
                             "and expert parallelism are not modelled by it (use the roofline)")
        if model.kv_element_bytes != model.dtype_bytes:
            # Its attention terms were measured on a KV cache of the model's own dtype.
            raise InputError(None, "kv_cache.dtype", model.kv_dtype,
                             f"the profile {config.path} was measured with the KV cache in "
                             "the model's dtype; an fp8 KV cache reads half the bytes, which "
                             "it cannot predict (use the roofline, or kv_cache.dtype: auto)")
        if model.linear_weight_bytes != model.dtype_bytes:
            raise InputError(None, "quantization", "fp8",
                             f"the profile {config.path} was measured with the model's weights "
                             "in its dtype; it cannot predict fp8 weights (use the roofline, "
                             "or measure a profile of the quantized model)")
        data = load_fitted(config.path)
        if data["model"] != model.name:
            raise InputError(config.path, "model", data["model"],
                             f"profile was measured for {data['model']}, scenario runs "
                             f"{model.name}")
        self.tensor_parallel = int(data.get("tensor_parallel", 1))
        if self.tensor_parallel != parallelism.tensor:
            # The scenario's split is at fault, not the profile: its field is named, relative to
            # the replica (the scenario's source and the replica's place are added by whoever
            # builds the model from a scenario).
            raise InputError(None, "parallelism.tensor", parallelism.tensor,
                             f"the profile {config.path} records tensor_parallel="
                             f"{self.tensor_parallel}: it times one GPU of a "
                             f"{self.tensor_parallel}-way split, not of the replica's "
                             f"parallelism.tensor {parallelism.tensor} (set that to "
                             f"{self.tensor_parallel}, or measure a shard with `servesim "
                             f"profile --tensor-parallel {parallelism.tensor}`)")
        self.comm: Collectives | None = None
        if self.tensor_parallel > 1:
            bandwidth = BandwidthCollectives(
                gpu.interconnect_bandwidth_bytes_s, config.interconnect_efficiency,
                config.all_reduce_latency_s, SEND_RECV_LATENCY_S)
            self.comm = Collectives(bandwidth, parallelism, config.all_reduce_table)
            # Per iteration: after each layer's attention and MLP, and the vocabulary-parallel
            # embedding's (as the roofline charges them).
            self.all_reduces = 2 * model.num_layers + 1
            self.activation_bytes = model.hidden_size * model.dtype_bytes  # per token
            self._comm_s = TokenTable(self._communication_s)
            # The shard computed its slice of the vocabulary's logits; they are gathered.
            self.logits_bytes = parallelism.logits_bytes_per_row(model)
            self._gather_s = TokenTable(self._logits_gather_s)
        self.knots = np.asarray(data["knots"], dtype=np.float64)
        self.knot_s = np.asarray(data["knot_s"], dtype=np.float64)
        self.coef = [float(data["coef"][name]) for name in TERMS]
        self.limits = {name: float(data["range"][name]) for name in RANGE_FEATURES}
        self.meta = {k: data.get(k) for k in ("model", "device_name", "holdout", "source")}
        noise = data.get("noise") or {}
        regimes = noise.get("regimes")
        self._noise_quantiles = None if regimes is None else {
            name: mean_one_quantiles(np.asarray(regimes[name]["quantiles"], dtype=np.float64))
            for name in REGIMES}
        self.measured_noise: dict[str, Any] | None = None if regimes is None else {
            "correlation": noise.get("correlation"),
            "ratios": {name: {"count": regimes[name]["count"],
                              "source": regimes[name].get("source")} for name in REGIMES},
            "use": f"latency.noise: {{kind: empirical, correlation: "
                   f"{noise.get('correlation') or 0.0}}}"}
        self.num_predicted = 0
        self.num_extrapolated = 0

    def iteration_time_s(self, shape: BatchShape) -> Num:
        self._count_extrapolation(shape)
        time = predict_s(shape, self.knots, self.knot_s, self.coef)
        if self.comm is not None:
            time = (time + self.communication_s(shape.num_tokens)
                    + self._gather_s(shape.num_sampled_tokens))
        return time

    def communication_s(self, num_tokens: Num) -> Num:
        """The all-reduces a tensor-parallel shard's iteration adds (0 for one GPU; the
        logits' gather comes on top, by rows sampled): a float for a scalar, an array for an
        array, element for element the same values."""
        if self.comm is None:
            return 0.0
        return self._comm_s(num_tokens)

    def _communication_s(self, num_tokens: np.ndarray) -> np.ndarray:
        assert self.comm is not None
        return self.all_reduces * self.comm.all_reduce(num_tokens * self.activation_bytes)

    def _logits_gather_s(self, num_sampled: np.ndarray) -> np.ndarray:
        assert self.comm is not None
        return self.comm.all_gather(num_sampled * self.logits_bytes)

    def _count_extrapolation(self, shape: BatchShape) -> None:
        beyond: Any = False
        for name, limit in self.limits.items():
            beyond = beyond | (np.asarray(getattr(shape, name)) > limit)
        beyond = np.broadcast_to(beyond, np.shape(shape.decode_kv_tokens) or ())
        self.num_predicted += max(1, int(np.size(shape.decode_kv_tokens)))
        self.num_extrapolated += int(np.count_nonzero(beyond))

    def describe(self) -> dict[str, Any]:
        """`measured_noise`: the profile's ratios and the correlation fitted to them (None for
        a profile fitted before they were kept); its `use` is the setting that applies both."""
        return {**self.meta, "tensor_parallel": self.tensor_parallel,
                "num_predicted_iterations": self.num_predicted,
                "num_extrapolated_iterations": self.num_extrapolated,
                "measured_noise": self.measured_noise}

    def noise_quantiles(self) -> dict[str, np.ndarray] | None:
        """The profile's measured/predicted ratios by regime, each rescaled to mean 1 (None
        for a profile fitted before they were kept)."""
        return self._noise_quantiles


class _Coef(BaseModel):
    """Seconds per unit of each term; the fit is non-negative least squares."""

    model_config = INPUT_MODEL
    prefill_attn_pairs: NonNegativeFloat
    prefill_kv_tokens: NonNegativeFloat
    decode_kv_tokens: NonNegativeFloat
    num_decode_tokens: NonNegativeFloat
    num_prefill_seqs: NonNegativeFloat
    num_sampled_tokens: NonNegativeFloat


class _Range(BaseModel):
    """The largest value of each feature measured: beyond it, predictions extrapolate."""

    model_config = INPUT_MODEL
    num_tokens: NonNegativeFloat
    prefill_attn_pairs: NonNegativeFloat
    decode_kv_tokens: NonNegativeFloat
    num_decode_tokens: NonNegativeFloat


class _RegimeRatios(BaseModel):
    """Measured/predicted ratios of one regime: their quantiles on an even grid of [0, 1]."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)  # other keys (notes) pass
    quantiles: list[PositiveFloat] = Field(min_length=2)
    count: int = Field(ge=1)  # timed repetitions they summarise

    @model_validator(mode="after")
    def _increasing(self) -> _RegimeRatios:
        back = next((i for i in range(1, len(self.quantiles))
                     if self.quantiles[i] < self.quantiles[i - 1]), None)
        if back is not None:
            raise invalid((f"quantiles.{back}", self.quantiles[back],
                           "quantiles must not decrease"))
        return self


class _Regimes(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    decode: _RegimeRatios
    mixed: _RegimeRatios
    prefill: _RegimeRatios


class _Noise(BaseModel):
    """What the fit leaves unexplained; both parts absent in a profile fitted before them (its
    timing-spread statistics, kept beside them, pass unchecked)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    regimes: _Regimes | None = None
    correlation: float | None = Field(None, ge=0, lt=1)  # lag-1, of the ratios in run order


class _Fitted(BaseModel):
    """The fields of a fitted profile the simulator reads (others, e.g. metadata, pass)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)  # other keys are kept
    model: str
    knots: list[PositiveFloat] = Field(min_length=2)  # token counts, increasing
    knot_s: list[NonNegativeFloat] = Field(min_length=2)  # g at each knot, seconds
    coef: _Coef
    range: _Range
    # GPUs of the tensor-parallel group whose one shard was measured (absent: 1, a whole model).
    tensor_parallel: int = Field(1, ge=1, le=MAX_GPUS_PER_REPLICA)
    noise: _Noise | None = None

    @model_validator(mode="after")
    def _curve(self) -> _Fitted:
        problems: list[Problem] = []
        if len(self.knot_s) != len(self.knots):
            problems.append(("knot_s", f"{len(self.knot_s)} values",
                             f"need one per knot ({len(self.knots)})"))
        back = next((i for i in range(1, len(self.knots))
                     if self.knots[i] <= self.knots[i - 1]), None)
        if back is not None:
            problems.append((f"knots.{back}", self.knots[back], "knots must increase"))
        if problems:
            raise invalid(*problems)
        return self


def load_fitted(path: Path, field: str = "latency.path") -> dict[str, Any]:
    """Read and check a fitted latency file: every problem found, one line each, naming the
    file and field. Returns the file's mapping. Read strictly (`sim.config.input_file`): a key given
    twice (JSON readers keep the last, silently), NaN, a 5,000-digit number or nesting past
    the recursion limit is refused, as is a file that is not a regular one. `field`: what
    named the file (a scenario's field, or a command-line option), named where it cannot be
    read."""
    data = read_json_file(Path(path), path, field, MAX_FITTED_BYTES)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        value = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise InputError(path, "format", value, f"expected {FORMAT} (run `servesim fit`)")
    try:
        _Fitted.model_validate(data)
    except ValidationError as exc:
        raise InputError.from_validation(path, exc) from None
    return data
