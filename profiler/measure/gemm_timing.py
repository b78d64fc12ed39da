"""Time one layer's linear GEMMs of a model on one device, in bf16 and in fp8 (W8A8).

The roofline's GEMM model (`sim.latency.gemm`) is fitted to public bf16 measurements; its fp8
form (`GemmModel.fp8`, for `quantization: fp8`) is an extrapolation no measurement has checked.
This measures what it predicts, on whatever GPU a session has, for `bench/gemm_vs_measured.py`
to compare:

    python -m profiler.measure.gemm_timing --model llama-3.1-8b --tensor-parallel 1 --device cuda \
        --out gemm_h100_llama-3.1-8b_tp1.csv

Shapes: each projection of one layer at its shard shape under tensor parallelism T, as
`sim.hardware.parallelism` times them (the fused QKV and output projections; a dense MLP's gate+up
and down), at token counts 1, 2, 4, ..., 4096 (or `--tokens`). Each GEMM runs `--warmup` untimed
calls, then `--reps` timed ones (CUDA events on a GPU, `perf_counter` on the CPU), and keeps
the median. bf16: `x @ w.T`, as `F.linear` runs it. fp8: `torch._scaled_mm` of e4m3 activations
and weights with per-tensor scales into bf16, as vLLM's `Fp8LinearMethod` calls it with dynamic
per-tensor activation scales; quantizing the input (a separate kernel) is not timed.

Writes a CSV, one row per GEMM: model, tensor_parallel, op, m, k, n, dtype, time_s, and the
device and torch version it ran on.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path
from typing import Any

from sim.hardware.models import MODELS, ModelShape
from sim.hardware.parallelism import Parallelism

COLUMNS = ("model", "tensor_parallel", "op", "m", "k", "n", "dtype", "time_s", "device",
           "torch")
DEFAULT_TOKENS = tuple(2**i for i in range(13))  # 1 .. 4096


def layer_gemms(model: ModelShape, tensor: int) -> list[tuple[str, int, int]]:
    """(op, k, n) of one layer's linear GEMMs on one GPU of a `tensor`-way split."""
    par = Parallelism(tensor=tensor)
    names = ["attn_qkv", "attn_out"] if not model.is_mla else [
        f"attn_{i}" for i in range(len(par.attention_projections(model)))]
    ops = [(name, k, n) for name, (k, n) in zip(names, par.attention_projections(model),
                                                 strict=True)]
    if model.num_dense_layers:
        width = model.intermediate_size // tensor
        ops += [("mlp_gate_up", model.hidden_size, 2 * width),
                ("mlp_down", width, model.hidden_size)]
    return ops


def _timer(torch: Any, device: str) -> Any:
    """A function timing `fn` once, in seconds."""
    if device.startswith("cuda"):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))

        def cuda(fn: Any) -> float:
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda

    def cpu(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu


def measure(model_name: str, tensor: int, device: str, tokens: tuple[int, ...], reps: int,
            warmup: int, seed: int = 0) -> list[dict[str, Any]]:
    """Time every (op, token count, dtype) of one layer; rows as `COLUMNS`."""
    import torch

    model = MODELS.get(model_name)
    torch.manual_seed(seed)
    timer = _timer(torch, device)
    one = torch.ones((), device=device, dtype=torch.float32)
    rows = []
    for op, k, n in layer_gemms(model, tensor):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        w8 = w.to(torch.float8_e4m3fn)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x8 = x.to(torch.float8_e4m3fn)
            calls = {
                "bf16": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                # w8.t() is column-major, as _scaled_mm wants its second operand.
                "fp8": lambda x8=x8, w8=w8: torch._scaled_mm(
                    x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            }
            for dtype, fn in calls.items():
                for _ in range(warmup):
                    fn()
                times = [timer(fn) for _ in range(reps)]
                rows.append({"model": model_name, "tensor_parallel": tensor, "op": op, "m": m,
                             "k": k, "n": n, "dtype": dtype,
                             "time_s": statistics.median(times),
                             "device": _device_name(torch, device),
                             "torch": torch.__version__})
    return rows


def _device_name(torch: Any, device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    import platform

    return f"cpu: {platform.processor() or platform.machine()}"


def write(rows: list[dict[str, Any]], out: Path) -> None:
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=MODELS.names())
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = measure(args.model, args.tensor_parallel, args.device, tuple(args.tokens),
                   args.reps, args.warmup)
    write(rows, args.out)
    print(f"{len(rows)} GEMMs timed on {rows[0]['device']} (torch {rows[0]['torch']}): "
          f"{args.out}")


if __name__ == "__main__":
    main()
