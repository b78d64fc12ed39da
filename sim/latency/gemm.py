"""Time of one bf16 GEMM on one GPU, fitted to public H100/A100 measurements.

A GEMM here is the linear layer of m tokens: [m x k] activations times [k x n] weights (the
per-GPU shard under tensor parallelism). Its time, with the datasheet roofline's hard
max(compute, memory) replaced by a fitted form:

    t(m) = 0                                                    if m == 0 (or k or n is 0)
    t(m) = (t0 + smax(t_mem, t_cmp)) * e(m)                     otherwise
    t_mem = 2 (k n + m k + m n) / B          bf16 weights read once, activations in and out
    t_cmp = 2 k n m' / F,  m' = m below one tile, else m rounded up to a multiple of T = 64
    smax(a, b) = (a + b + sqrt((a - b)^2 + c a b)) / 2
    e(m)  = the GPU's efficiency correction: a factor interpolated linearly (np.interp) between
            knots at 1, 2, 4, 8 and every 16 tokens to 4096, constant beyond (1 if none)

Four fitted parameters per GPU, each a physical quantity (fitted values: H100 SXM / A100 80GB):

- `launch_s` (t0): the fixed cost of one GEMM: launch, pipeline fill and drain (6.2 / 6.4 us;
  an effective figure: the smallest measured GEMMs take 4 / 7 us in all, and the fit trades t0
  against B, so a 7B model's TP8 shards at a few tokens come out up to 38% slow on the H100).
- `flops_s` (F): the FLOP/s a large GEMM sustains (747 / 233 TFLOP/s, 75% of the dense
  datasheet figure on both).
- `bytes_s` (B): the bandwidth at which weights and activations stream (3.35 / 1.74 TB/s; the
  H100's sits at the datasheet figure, the bound of the fit).
- `overlap` (c, 0 to 4): how well memory traffic and math overlap where neither bound
  dominates (the ridge region). c = 0 gives max(a, b), perfect overlap; c = 4 gives a + b, none.
  At a = b the time is a (1 + sqrt(c) / 2) (c = 1.58 / 0.97: 1.63 / 1.49 times a).

and one fixed constant, the row tile T = 64: from one tile on, tensor-core GEMM kernels work in
tiles of 64 (or 128) rows, so a batch of 65 tokens costs the math of 128 (tile quantisation).
Below one tile (decode-sized batches) the kernels are memory-bound skinny GEMMs and the math
term is proportional to m. Wave quantisation (whole waves of tiles over the SMs) and the
library's choice of kernel per shape make the measured times jump by 10-100% at particular
token counts, differently per shape and not monotonically; a smooth form cannot follow those
steps and no non-decreasing one can follow the drops.

The efficiency correction e(m) is where the steps that every shape shares go: one factor per
token count for each measured GPU (its kernels' efficiency as a function of tokens per
iteration), fitted jointly over all its models and TP degrees with a smoothness penalty (0.86
to 1.21 on the H100, 0.94 to 1.10 on the A100). It makes the time non-monotone in m, as the
measurements are. Against the measured four-GEMM sum of a layer (every row of 1-4096 tokens,
seven models, TP 1-8):

    rows within 10% (worst rows)   smooth form alone         with the correction
    A100 80GB                      93.8% (0.76, 1.20)        95.6% (0.79, 1.20)
    H100 SXM                       82.7% (0.70, 1.38)        90.8% (0.76, 1.39)

where the naive roofline gives 0.31 to 1.33. Fitted on all models but one and tested on the one
left out (each in turn), the correction still gives 94.3% (0.78, 1.19) and 88.6% (0.75, 1.44):
it generalises across models, so `for_gpu` applies it by default (`correction=False` gives the
smooth form alone). What neither form follows are the steps of particular shapes (e.g.
Llama-2-7B at TP8: 1.39 at one token on the H100, launch-bound; 0.79 near 800 tokens on the
A100); one factor of m shared by every shape cannot, so not every row is within 10%.
bench/calibrate_gemm.py prints the tables and the rows that miss. The smooth form is
non-decreasing in m, homogeneous in the two times; the whole uses only +, -, *, /, sqrt, ceil
and np.interp, element by element, so an array gives bit for bit the floats that scalar calls
give.

Calibration: `sim/data/gemm_calibration.json`, written by `bench/calibrate_gemm.py` from Vidur's
operator measurements (github.com/microsoft/vidur, MIT; the fused QKV, output, gate+up and down
projections of seven Llama-family models at tensor-parallel degrees 1-8, 1-4096 tokens), fitted
on the sum of a layer's four GEMMs. It holds `h100-sxm` and `a100-80gb`.

Other GPUs are extrapolated: the H100's curve with its compute and memory terms scaled by the
datasheet ratios (F and B at the same fractions of the GPU's dense bf16 FLOP/s and bandwidth as
fitted on the H100; t0, c and T kept), without the H100's efficiency correction (its steps
belong to the H100's kernels and SM count; an extrapolated GPU gets the smooth, non-decreasing
form). `extrapolated` says so, and `describe()` carries it.

`naive` is the datasheet roofline servesim used before: max(2 m k n / (peak * mfu),
2 k n / (bandwidth * mbu)), weights only, no launch cost (mfu 0.6 and mbu 0.8 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

from sim.config.input_file import loads, read_bytes
from sim.hardware.gpus import GPUSpec

CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "data" / "gemm_calibration.json"
MAX_CALIBRATION_BYTES = 10 * 2**20  # a few KB per GPU
REFERENCE_GPU = "h100-sxm"  # the curve other GPUs are extrapolated from
DTYPE_BYTES = 2  # bf16
_CHUNK = 4096  # entries evaluated at a time

Form = Literal["calibrated", "extrapolated", "naive"]


@dataclass(frozen=True)
class GemmParams:
    launch_s: float  # t0: fixed cost of one GEMM, seconds
    flops_s: float  # F: sustained FLOP/s
    bytes_s: float  # B: bytes/s of weights and activations
    overlap: float  # c in [0, 4]: 0 = max(memory, math), 4 = memory + math
    m_tile: int = 64  # T: rows of a tile; math is paid for whole tiles from one tile on

    def __post_init__(self) -> None:
        if not (self.launch_s >= 0 and self.flops_s > 0 and self.bytes_s > 0
                and 0 <= self.overlap <= 4 and self.m_tile >= 1):
            raise ValueError(f"GEMM parameters out of range: {self}")


@dataclass(frozen=True)
class GemmModel:
    """Seconds of one GEMM; build with `for_gpu` (or `naive`), call `time_s(m, k, n)`."""

    params: GemmParams
    gpu: str
    form: Form
    source: str = ""
    # The per-GPU efficiency correction: (knots in tokens, factors), the time multiplied by the
    # factor interpolated linearly between knots and held constant outside them; None: none.
    correction: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # Bytes per element of the weights, of the activations read and of those written: bf16's
    # 2, 2, 2; fp8 weights with fp8 activations (W8A8) 1, 1, 2; fp8 weights alone (W8A16,
    # where the GPU has no fp8 math) 1, 2, 2.
    weight_bytes: int = DTYPE_BYTES
    input_bytes: int = DTYPE_BYTES
    output_bytes: int = DTYPE_BYTES

    def __post_init__(self) -> None:
        if self.correction is not None:
            _check_correction(*self.correction)

    @property
    def extrapolated(self) -> bool:
        return self.form == "extrapolated"

    @cached_property
    def _correction_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.correction is None:
            return None
        return (np.array(self.correction[0], dtype=np.float64),
                np.array(self.correction[1], dtype=np.float64))

    def efficiency_factor(self, m: Any) -> Any:
        """The correction's factor at `m` tokens (1.0 where there is none): the time of the
        smooth form is multiplied by it."""
        arrays = self._correction_arrays
        if arrays is None:
            return np.ones_like(np.asarray(m, dtype=np.float64))[()]
        return np.interp(np.asarray(m, dtype=np.float64), arrays[0], arrays[1])[()]

    @classmethod
    def for_gpu(cls, spec: GPUSpec, calibrated: bool = True, *, correction: bool = True,
                mfu: float = 0.6, mbu: float = 0.8) -> GemmModel:
        """The calibrated model of `spec` (extrapolated from the H100 where it was not measured),
        or with `calibrated=False` the datasheet roofline at `mfu` and `mbu`. `correction`: apply
        the measured GPU's efficiency-vs-tokens correction (measured GPUs only; extrapolated
        ones never get one); False gives the smooth, non-decreasing form alone."""
        if not calibrated:
            return cls.naive(spec, mfu, mbu)
        gpus = _calibration()["gpus"]
        if spec.measured_as in gpus:
            entry = gpus[spec.measured_as]
            corr = _correction(entry) if correction else None
            return cls(_params(entry["params"]), spec.name, "calibrated",
                       f"fitted to measurements ({CALIBRATION_PATH.name})"
                       + ("" if spec.measured_as == spec.name
                          else f" of {spec.measured_as}, whose figures it has")
                       + (", with its efficiency-vs-tokens correction" if corr else ""), corr)
        ref = gpus[REFERENCE_GPU]["params"]
        params = GemmParams(
            launch_s=float(ref["launch_s"]),
            flops_s=float(ref["flops_fraction"]) * spec.peak_bf16_flops,
            bytes_s=float(ref["bandwidth_fraction"]) * spec.memory_bandwidth_bytes_s,
            overlap=float(ref["overlap"]), m_tile=int(ref["m_tile"]))
        return cls(params, spec.name, "extrapolated",
                   f"extrapolated from {REFERENCE_GPU}'s fit by datasheet FLOP/s and bandwidth "
                   f"ratios (no measurements of {spec.name})")

    def fp8(self, spec: GPUSpec) -> GemmModel:
        """This model for fp8 weights (vLLM's `quantization: fp8`). Where `spec` has fp8
        tensor cores (W8A8: activations quantized to fp8 too), the math runs at the same
        fraction of the fp8 peak as this model's at the bf16 peak; elsewhere (W8A16) at this
        model's rate. Weights stream at one byte each. Not measured: the result is marked
        extrapolated and drops the bf16 efficiency correction, whose steps are cuBLAS's bf16
        kernels' (the naive form stays naive)."""
        w8a8 = spec.peak_fp8_flops is not None
        params = self.params
        if w8a8:
            params = replace(params, flops_s=params.flops_s * (spec.matmul_flops(fp8=True)
                                                               / spec.peak_bf16_flops))
        kind = "W8A8 at the fp8 peak" if w8a8 else "W8A16 (no fp8 math on this GPU)"
        naive = self.form == "naive"
        return replace(self, params=params, form=self.form if naive else "extrapolated",
                       source=f"{self.source}; fp8 weights, {kind}"
                       + ("" if naive else ", not measured"),
                       correction=None if not naive else self.correction,
                       weight_bytes=1, input_bytes=1 if w8a8 else DTYPE_BYTES)

    @classmethod
    def naive(cls, spec: GPUSpec, mfu: float = 0.6, mbu: float = 0.8, *,
              fp8: bool = False) -> GemmModel:
        """max(FLOPs at `mfu` of peak, weight bytes at `mbu` of bandwidth): the datasheet
        roofline, no launch cost, no activations, no tiles. `fp8`: for fp8 weights, as
        `fp8()` makes it, at `mfu` of the fp8 peak itself (where the GPU has fp8 math)."""
        params = GemmParams(0.0, spec.peak_bf16_flops * mfu,
                            spec.memory_bandwidth_bytes_s * mbu, 0.0, 1)
        model = cls(params, spec.name, "naive", f"datasheet roofline, mfu {mfu}, mbu {mbu}")
        if not fp8:
            return model
        # `fp8()` scales the bf16 rate by the peaks' ratio, which rounds differently where
        # that ratio is not exact in binary (L40S): the product itself, as the roofline had it.
        return replace(model.fp8(spec), params=replace(
            params, flops_s=spec.matmul_flops(fp8=True) * mfu))

    @overload
    def time_s(self, m: int | float | np.integer | np.floating, k: int, n: int) -> float: ...

    @overload
    def time_s(self, m: np.ndarray, k: int, n: int) -> np.ndarray: ...

    def time_s(self, m: Any, k: int, n: int) -> Any:
        """Seconds of [m x k] @ [k x n] in bf16; m tokens (>= 0; fractions allowed, e.g. the
        expected tokens per MoE expert), element-wise on an array, each entry bit for bit what
        the scalar call gives. 0 for m == 0."""
        if np.ndim(m) == 0:
            return float(self._eval(np.array([m], dtype=np.float64), k, n)[0])
        return self._eval(np.asarray(m, dtype=np.float64), k, n)

    def _eval(self, m: np.ndarray, k: int, n: int) -> np.ndarray:
        if not np.all(m >= 0):  # also refuses NaN
            raise ValueError(f"token counts must be >= 0, got min {np.min(m)}")
        if k <= 0 or n <= 0:
            return np.zeros_like(m)
        if m.size <= _CHUNK:
            return self._kernel(m, k, n)
        # Chunks keep the temporaries small (cache-resident, no fresh pages per call); the
        # arithmetic per entry is the same.
        flat = m.ravel()
        out = np.empty_like(flat)
        for start in range(0, flat.size, _CHUNK):
            out[start:start + _CHUNK] = self._kernel(flat[start:start + _CHUNK], k, n)
        return out.reshape(m.shape)

    def _kernel(self, m: np.ndarray, k: int, n: int) -> np.ndarray:
        p = self.params
        kn2 = 2.0 * float(k) * float(n)  # FLOPs per token
        weights = float(self.weight_bytes * k * n)  # bytes (bf16: kn2 to the last bit)
        idle = m == 0
        # In place, a few buffers.
        if self.form == "naive":
            t = np.multiply(m, kn2)
            t /= p.flops_s
            np.maximum(t, weights / p.bytes_s, out=t)
            t[idle] = 0.0
            return t
        tile = float(p.m_tile)
        b = np.divide(m, tile)  # math: 2 k n m' / F
        np.ceil(b, out=b)
        b *= tile
        np.copyto(b, m, where=m < tile)
        b *= kn2
        b /= p.flops_s
        # memory: (w k n + m (i k + o n)) / B, bytes of weights, inputs and outputs (bf16:
        # 2 (k n + m (k + n)))
        a = np.multiply(m, float(self.input_bytes * k + self.output_bytes * n))
        a += weights
        a /= p.bytes_s
        s = np.subtract(a, b)  # smax(a, b) = (a + b + sqrt((a - b)^2 + c a b)) / 2
        s *= s
        ab = np.multiply(a, b)
        ab *= p.overlap
        s += ab
        np.sqrt(s, out=s)
        a += b
        a += s
        a *= 0.5
        a += p.launch_s
        arrays = self._correction_arrays
        if arrays is not None:
            a *= np.interp(m, arrays[0], arrays[1])
        a[idle] = 0.0
        return a

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {"gemm_model": self.form, "gemm_gpu": self.gpu, "gemm_source": self.source,
                "gemm_launch_s": p.launch_s, "gemm_flops_s": p.flops_s,
                "gemm_bytes_s": p.bytes_s, "gemm_overlap": p.overlap, "gemm_m_tile": p.m_tile,
                "gemm_correction": "none" if self.correction is None else
                f"{len(self.correction[0])} knots, {self.correction[0][0]:g}-"
                f"{self.correction[0][-1]:g} tokens, factors {min(self.correction[1]):.3f}-"
                f"{max(self.correction[1]):.3f}"}


def _check_correction(knots: Any, factors: Any) -> None:
    k = np.asarray(knots, dtype=np.float64)
    f = np.asarray(factors, dtype=np.float64)
    if not (k.ndim == 1 and k.shape == f.shape and len(k) >= 1 and np.all(np.diff(k) > 0)
            and np.all(np.isfinite(k)) and np.all(np.isfinite(f)) and np.all(f > 0)):
        raise ValueError("efficiency correction: knots must increase, factors be > 0, "
                         "one factor per knot")


def _correction(entry: dict[str, Any]) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    corr = entry.get("correction")
    if corr is None:
        return None
    knots = tuple(float(v) for v in corr["knots"])
    factors = tuple(float(v) for v in corr["factors"])
    _check_correction(knots, factors)
    return knots, factors


def _params(entry: dict[str, Any]) -> GemmParams:
    return GemmParams(float(entry["launch_s"]), float(entry["flops_s"]), float(entry["bytes_s"]),
                      float(entry["overlap"]), int(entry["m_tile"]))


@lru_cache(maxsize=1)
def _calibration() -> dict[str, Any]:
    return load_calibration(CALIBRATION_PATH)


def load_calibration(path: Path) -> dict[str, Any]:
    """The calibration file, checked: every GPU has the five parameters and the fractions that
    extrapolation uses, and the reference GPU is there."""
    try:
        data = loads(read_bytes(path, MAX_CALIBRATION_BYTES))
        gpus = data["gpus"]
        for entry in gpus.values():
            _params(entry["params"])
            _correction(entry)
            float(entry["params"]["flops_fraction"])
            float(entry["params"]["bandwidth_fraction"])
        gpus[REFERENCE_GPU]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path}: not a usable GEMM calibration ({type(e).__name__}: {e}); "
                           "rewrite it with bench/calibrate_gemm.py") from e
    return data  # type: ignore[no-any-return]
