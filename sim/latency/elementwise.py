"""Time of a layer's per-token elementwise kernels and of the embedding lookup, fitted to public
H100/A100 measurements.

Besides its GEMMs, a decoder layer runs kernels that read and write each token's activations
once: the two RMSNorms, the rotary embedding of queries and keys, the MLP's activation (SiLU
times the gate) and the residual add; each iteration also looks its tokens up in the embedding
table. They are memory-bound and, in Vidur's measurements of seven Llama-family models on the
H100 and A100, take 3-39% of the token-proportional time of a layer (its GEMMs plus these; 10%
on the A100 and 12.6% on the H100 at the median, most for small models split many ways): a
roofline of GEMMs alone is that much fast. `RooflineConfig.elementwise: calibrated`, the
default, adds them; `none` leaves them out (see docs/fidelity.md for the evidence and why).

Each kernel `op` on m tokens, each token a row of `row_bytes` read and written on this GPU:

    t(m) = 0                                                  if m == 0
    t(m) = launch_s + row_bytes * max(1 / row_bytes_s, m / bytes_s)   otherwise

- `launch_s`: the fixed cost of one launch (0.6-2.3 us fitted);
- `row_bytes_s`: how fast one row streams when there are too few rows to fill the GPU (a row is
  one thread block's work, so a few tokens of a wide MLP take longer than a few of a narrow one:
  the measured activation kernel at one token takes 22 us on Llama-3-70B's 28,672-wide MLP,
  11 us on Llama-3-8B's 14,336, on the A100);
- `bytes_s`: the bandwidth many rows reach together (a fraction of the datasheet's).

Three parameters per kernel and GPU, fitted by `bench/calibrate_elementwise.py` (log least
squares over every measured row of 1-4,096 tokens, every model and tensor-parallel degree) into
`sim/data/elementwise_calibration.json`. Row bytes per token on one GPU (bf16 or the model's
dtype, b bytes; h hidden size, t tensor-parallel degree):

    input_layernorm, post_attention_layernorm   2 h b          (in, out: every GPU normalises
                                                                the whole hidden state)
    attn_rope      2 (q heads + KV heads on this GPU) x rotary dims x b
    mlp_act        3 (MLP width / t) b    (gate and up in, product out); an MoE layer: its
                   routed experts' widths (k experts per token) and its shared expert's
    add            3 h b                  (two in, one out)
    emb            2 h b, once per iteration

Approximations, said plainly: the measured kernels are vLLM-era unfused ones, one of each per
layer as Vidur times them (engines that fuse the residual add into the norm run fewer); MLA's
rotary part is taken as its `qk_rope_head_dim` on every query head and one shared key; MoE
activations are sized by the tokens' expected rows, with no launch per expert. Other GPUs are
extrapolated from the H100's figures, both bandwidths scaled by the datasheet bandwidth ratio
(`extrapolated`, carried by `describe()`). Only +, *, / and max, element by element: an array
gives bit for bit what scalar calls give.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sim.config.input_file import FileProblem, loads, read_bytes
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import Parallelism

CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "data" / "elementwise_calibration.json"
MAX_CALIBRATION_BYTES = 2**20
REFERENCE_GPU = "h100-sxm"  # the figures other GPUs are extrapolated from
LAYER_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
EMBEDDING = "emb"  # once per iteration
OPS = (EMBEDDING, *LAYER_OPS)

Form = Literal["calibrated", "extrapolated"]


@dataclass(frozen=True)
class KernelParams:
    launch_s: float  # fixed cost of one launch
    row_bytes_s: float  # bytes/s of one row, where too few rows fill the GPU
    bytes_s: float  # bytes/s of many rows together

    def __post_init__(self) -> None:
        if not (self.launch_s >= 0 and self.row_bytes_s > 0 and self.bytes_s > 0):
            raise ValueError(f"elementwise kernel parameters out of range: {self}")

    def time_s(self, m: Any, row_bytes: float) -> Any:
        """Seconds for `m` rows (tokens) of `row_bytes` each; 0 for none."""
        m = np.asarray(m, dtype=np.float64)
        busy = self.launch_s + row_bytes * np.maximum(1.0 / self.row_bytes_s, m / self.bytes_s)
        return np.where(m > 0, busy, 0.0)


def row_bytes(model: ModelShape, parallelism: Parallelism) -> dict[str, tuple[float, float]]:
    """Per kernel: bytes of one token's row on one GPU of `parallelism`, in (dense layers, MoE
    layers); the norms, rotary part, add and embedding are the same in both."""
    b, h, t = model.dtype_bytes, model.hidden_size, parallelism.tensor
    q_heads = model.num_heads // t
    if model.is_mla:  # one rotary key shared by the heads, and each query head's rotary part
        rope = 2 * (q_heads + 1) * model.qk_rope_head_dim * b
    else:
        rope = 2 * (q_heads + parallelism.kv_heads_per_gpu(model)) * model.head_dim * b
    dense_act = 3 * model.intermediate_size / t * b
    moe_act = 3 * (model.num_experts_per_token * model.moe_intermediate_size
                   + model.shared_expert_intermediate_size) / t * b
    same = {"input_layernorm": 2 * h * b, "post_attention_layernorm": 2 * h * b,
            "attn_rope": rope, "add": 3 * h * b, EMBEDDING: 2 * h * b}
    return {**{op: (float(v), float(v)) for op, v in same.items()},
            "mlp_act": (float(dense_act), float(moe_act))}


@dataclass(frozen=True)
class ElementwiseModel:
    """The elementwise kernels of one GPU; build with `for_gpu`, call `iteration_s`."""

    params: dict[str, KernelParams]
    gpu: str
    form: Form
    source: str = ""

    @classmethod
    def for_gpu(cls, gpu: GPUSpec) -> ElementwiseModel:
        """The GPU's fitted kernels, or the H100's scaled to its bandwidth."""
        fitted, source = _calibration()
        if gpu.measured_as in fitted:
            return cls(fitted[gpu.measured_as], gpu.name, "calibrated", source)
        from sim.hardware.gpus import GPUS

        ratio = gpu.memory_bandwidth_bytes_s / GPUS.get(REFERENCE_GPU).memory_bandwidth_bytes_s
        scaled = {op: KernelParams(p.launch_s, p.row_bytes_s * ratio, p.bytes_s * ratio)
                  for op, p in fitted[REFERENCE_GPU].items()}
        return cls(scaled, gpu.name, "extrapolated", source)

    def iteration_s(self, m: Any, model: ModelShape, parallelism: Parallelism) -> Any:
        """Seconds of one iteration's elementwise kernels on one GPU for `m` tokens: each
        layer's (every stage's, under pipeline parallelism: a prediction is the whole pass)
        and the embedding's."""
        rows = row_bytes(model, parallelism)
        time = self.params[EMBEDDING].time_s(m, rows[EMBEDDING][0])
        for op in LAYER_OPS:
            dense, moe = rows[op]
            kernel = self.params[op]
            if dense == moe:
                time = time + model.num_layers * kernel.time_s(m, dense)
            else:
                time = (time + model.num_dense_layers * kernel.time_s(m, dense)
                        + model.num_moe_layers * kernel.time_s(m, moe))
        return time

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"elementwise_form": self.form}
        if self.form == "extrapolated":
            facts["elementwise_note"] = (
                f"no elementwise measurements for {self.gpu}: the {REFERENCE_GPU}'s kernels "
                "scaled by the datasheet bandwidth ratio")
        return facts


@lru_cache(maxsize=1)
def _calibration() -> tuple[dict[str, dict[str, KernelParams]], str]:
    return load_calibration(CALIBRATION_PATH)


def load_calibration(path: Path) -> tuple[dict[str, dict[str, KernelParams]], str]:
    """Each GPU's kernels (every one of OPS, parameters in range; the reference GPU there) and
    the data's source."""
    try:
        data = loads(read_bytes(path, MAX_CALIBRATION_BYTES))
        fitted = {gpu: {op: KernelParams(**values) for op, values in ops.items()}
                  for gpu, ops in data["gpus"].items()}
        for gpu, ops in fitted.items():
            if set(ops) != set(OPS):
                raise ValueError(f"{gpu}: kernels {sorted(ops)}, not {list(OPS)}")
        fitted[REFERENCE_GPU]
    except (OSError, FileProblem, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RuntimeError(f"{path}: not a usable elementwise calibration ({type(e).__name__}: "
                           f"{e}); rewrite it with bench/calibrate_elementwise.py") from e
    return fitted, str(data.get("source", {}).get("data", ""))
