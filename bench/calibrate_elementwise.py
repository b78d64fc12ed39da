"""Fit `sim.latency.elementwise`'s kernel model to Vidur's public H100/A100 measurements.

Reads the same `compute/{h100,a100}/<org>/<model>/mlp.csv` files as bench/calibrate_gemm.py
(under ../shared/profiles/vidur by default; never copied into the repository): the `median`
of each elementwise kernel (`emb`, `input_layernorm`, `attn_rope`, `post_attention_layernorm`,
`mlp_act`, `add`) at 1-4,096 tokens, every model and tensor-parallel degree. Per GPU and
kernel, fits launch_s, row_bytes_s and bytes_s (log least squares, scipy), writes
sim/data/elementwise_calibration.json and prints how the model fares:

- per GPU and kernel: min/median/max of predicted/measured, and the share within 10%;
- per GPU: the layer's five kernels together (what the roofline adds per layer), the share
  within 10% and 20% and the worst rows; and how much of the measured token-proportional layer
  time (the four GEMMs plus these five) the roofline missed without them.

    python bench/calibrate_elementwise.py [VIDUR_DIR] [--markdown] [--no-write]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.calibrate_gemm import DEFAULT_VIDUR, GPU_DIRS, MAX_TOKENS, VIDUR_COMMIT  # noqa: E402
from bench.calibrate_gemm import OPS as GEMM_OPS  # noqa: E402
from sim.hardware.models import ModelShape  # noqa: E402
from sim.hardware.parallelism import Parallelism  # noqa: E402
from sim.latency.elementwise import (  # noqa: E402
    CALIBRATION_PATH,
    LAYER_OPS,
    OPS,
    KernelParams,
)
from sim.latency.elementwise import row_bytes as elementwise_row_bytes  # noqa: E402


def row_bytes(r: dict[str, str]) -> dict[str, float]:
    """Bytes of one token's row per kernel for a Vidur row's shape (bf16), counted by
    `sim.latency.elementwise.row_bytes` for a one-layer model of that shape."""
    h, heads = int(r["n_embd"]), int(r["n_head"])
    if r["use_gated_mlp"].strip().lower() not in ("true", "1"):
        raise ValueError("a non-gated MLP: servesim models SwiGLU MLPs only")
    shape = ModelShape("vidur row", 1, h, heads, int(r["n_kv_head"]), h // heads,
                       int(r["n_expanded_embd"]), int(r["vocab_size"]))
    split = Parallelism(tensor=int(r["num_tensor_parallel_workers"]))
    return {op: dense for op, (dense, _) in elementwise_row_bytes(shape, split).items()}


def load(vidur: Path) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str]]:
    """Per GPU: columns `m`, `key` (model, TP, tokens), per kernel `<op>_bytes` and `<op>_s`,
    and `gemm_s` (the four GEMMs' sum); and each file's sha256."""
    out: dict[str, dict[str, list]] = {}
    files = {}
    for path in sorted((vidur / "compute").glob("*/*/*/mlp.csv")):
        if path.parts[-4] not in GPU_DIRS:
            continue
        files[str(path.relative_to(vidur))] = hashlib.sha256(path.read_bytes()).hexdigest()
        cols = out.setdefault(GPU_DIRS[path.parts[-4]], {})
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                m = int(r["num_tokens"])
                if not 1 <= m <= MAX_TOKENS:
                    continue
                cols.setdefault("m", []).append(m)
                cols.setdefault("key", []).append(
                    f"{path.parts[-2]} TP{r['num_tensor_parallel_workers']} {m}")
                for op, size in row_bytes(r).items():
                    cols.setdefault(f"{op}_bytes", []).append(size)
                    cols.setdefault(f"{op}_s", []).append(
                        float(r[f"time_stats.{op}.median"]) * 1e-3)
                cols.setdefault("gemm_s", []).append(
                    sum(float(r[f"time_stats.{op}.median"]) for op in GEMM_OPS) * 1e-3)
    if not out:
        raise FileNotFoundError(f"no compute/<gpu>/<org>/<model>/mlp.csv under {vidur}")
    return {gpu: {k: np.array(v) for k, v in cols.items()} for gpu, cols in out.items()}, files


def predict(p: KernelParams, m: np.ndarray, size: np.ndarray) -> np.ndarray:
    """`KernelParams.time_s`, each row with its own bytes (every measured row has tokens)."""
    return np.asarray(p.time_s(m, size))


def fit(m: np.ndarray, size: np.ndarray, measured: np.ndarray) -> KernelParams:
    """launch_s, row_bytes_s, bytes_s minimising the squared log ratios; 4 digits kept."""
    from scipy.optimize import least_squares

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.log(predict(KernelParams(*np.exp(z)), m, size) / measured)

    z = least_squares(residuals, np.log([2e-6, 1e10, 1e12])).x
    return KernelParams(*(float(f"{v:.4g}") for v in np.exp(z)))


def share(ratio: np.ndarray, within: float) -> float:
    return float(np.mean(np.abs(ratio - 1) <= within))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("vidur", nargs="?", type=Path, default=DEFAULT_VIDUR)
    parser.add_argument("--markdown", action="store_true", help="tables as Markdown")
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON")
    args = parser.parse_args()
    data, files = load(args.vidur.resolve())
    fitted: dict[str, dict[str, KernelParams]] = {}
    sep = " | " if args.markdown else "  "
    print(sep.join(["GPU", "kernel", "rows", "launch us", "row GB/s", "GB/s", "min", "median",
                    "max", "within 10%"]))
    layer_ratio = {}
    for gpu, cols in sorted(data.items()):
        m = cols["m"]
        fitted[gpu] = {op: fit(m, cols[f"{op}_bytes"], cols[f"{op}_s"]) for op in OPS}
        layer_pred = np.zeros(len(m))
        layer_meas = np.zeros(len(m))
        for op in OPS:
            p = fitted[gpu][op]
            pred = predict(p, m, cols[f"{op}_bytes"])
            ratio = pred / cols[f"{op}_s"]
            if op in LAYER_OPS:
                layer_pred += pred
                layer_meas += cols[f"{op}_s"]
            print(sep.join([gpu, op, str(len(m)), f"{p.launch_s * 1e6:.2f}",
                            f"{p.row_bytes_s / 1e9:.1f}", f"{p.bytes_s / 1e9:,.0f}",
                            f"{ratio.min():.2f}", f"{np.median(ratio):.2f}",
                            f"{ratio.max():.2f}", f"{100 * share(ratio, 0.1):.1f}%"]))
        layer_ratio[gpu] = (layer_pred / layer_meas, layer_meas / (layer_meas + cols["gemm_s"]),
                            cols["key"])
    print()
    print(sep.join(["GPU", "layer's five kernels: within 10%", "within 20%", "min", "max",
                    "their share of GEMMs + kernels: min", "median", "max"]))
    for gpu, (ratio, part, keys) in sorted(layer_ratio.items()):
        print(sep.join([gpu, f"{100 * share(ratio, 0.1):.1f}%", f"{100 * share(ratio, 0.2):.1f}%",
                        f"{ratio.min():.2f} ({keys[ratio.argmin()]})",
                        f"{ratio.max():.2f} ({keys[ratio.argmax()]})",
                        f"{100 * part.min():.1f}%", f"{100 * np.median(part):.1f}%",
                        f"{100 * part.max():.1f}%"]))
    if args.no_write:
        return
    payload = {
        "description": ("Fitted parameters of sim/latency/elementwise.py's kernel model, t = "
                        "launch_s + row_bytes * max(1/row_bytes_s, m/bytes_s) per kernel and "
                        "GPU. Written by bench/calibrate_elementwise.py."),
        "source": {"data": f"Vidur (github.com/microsoft/vidur@{VIDUR_COMMIT}, MIT) operator "
                           "timings, compute/*/*/*/mlp.csv, median column, 1-4096 tokens",
                   "files_sha256": files},
        "fit_date": datetime.date.today().isoformat(),
        "gpus": {gpu: {op: vars(p) for op, p in ops.items()} for gpu, ops in fitted.items()},
    }
    CALIBRATION_PATH.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {CALIBRATION_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
