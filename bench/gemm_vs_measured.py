"""The roofline's GEMM model against GEMMs timed on a device (`profiler.measure.gemm_timing`).

    python bench/gemm_vs_measured.py gemm_h100_llama-3.1-8b_tp1.csv [--gpu h100-sxm]

For each dtype (bf16: the calibrated model; fp8: its W8A8/W8A16 extrapolation, `GemmModel.fp8`)
and op, prints predicted/measured at each token count, then the share of rows within 10% and
20% and the range. Only a GPU of the kind `--gpu` names makes the comparison mean anything (a
CPU's timings are printed, flagged, for the plumbing's sake).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.hardware.gpus import GPUS, measured_on  # noqa: E402
from sim.latency.gemm import GemmModel  # noqa: E402


def compare(rows: list[dict[str, str]], gpu_name: str) -> list[str]:
    """Lines of the report."""
    gpu = GPUS.get(gpu_name)
    models = {"bf16": GemmModel.for_gpu(gpu), "fp8": GemmModel.for_gpu(gpu).fp8(gpu)}
    lines = []
    device = rows[0]["device"]
    if not measured_on(gpu_name, device):
        lines.append(f"note: measured on {device!r}, compared with {gpu_name}: the ratios say "
                     "nothing about the model")
    table: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        m, k, n = int(row["m"]), int(row["k"]), int(row["n"])
        predicted = models[row["dtype"]].time_s(m, k, n)
        table[(row["dtype"], f"{row['op']} {k}x{n}")].append((m, predicted / float(row["time_s"])))
    for dtype in models:
        ratios = [r for (d, _), values in table.items() if d == dtype for _, r in values]
        if not ratios:
            continue
        lines.append(f"{dtype} ({models[dtype].form}): predicted / measured")
        for (d, op), values in table.items():
            if d == dtype:
                lines.append(f"  {op:<26} " + " ".join(f"{m}:{r:.2f}" for m, r in values))
        r = np.array(ratios)
        lines.append(f"  {len(r)} GEMMs: within 10% {np.mean(np.abs(r - 1) <= 0.1):.0%}, "
                     f"within 20% {np.mean(np.abs(r - 1) <= 0.2):.0%}, "
                     f"{r.min():.2f} to {r.max():.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--gpu", default="h100-sxm", choices=GPUS.names())
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.csv}: no GEMMs")
    print(f"{len(rows)} GEMMs of {rows[0]['model']} at TP{rows[0]['tensor_parallel']} on "
          f"{rows[0]['device']} (torch {rows[0]['torch']})")
    print("\n".join(compare(rows, args.gpu)))


if __name__ == "__main__":
    main()
